"""The AWS twin (`fab local-up --aws`): the cluster's AWS side as `pulumi up` leaves it, on one machine, for
rehearsing the AWS flow. Imports cluster and core; nothing below it imports it."""
