"""What every package shares: errors, contract constants, the Jinja environment, the instance catalog."""
