"""`fab sweep`: what of a cluster is left in its region (find), its deletion in dependency order (delete), and the
command itself (run). Imports cluster and core; nothing below it imports it."""
