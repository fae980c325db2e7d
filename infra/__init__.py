"""The Pulumi components of a spot Xeon cluster on AWS: settings, network, image pipeline, nodes, cost.

Only network, image and nodes import pulumi; settings and cost are plain Python.
"""
