"""`fab -l` lists the tasks; the work lives in node_setup/."""
from node_setup.tasks import ns  # noqa: F401
