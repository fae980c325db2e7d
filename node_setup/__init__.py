"""Setting nodes up: software profiles (profiles.toml), the rendered setup script, `fab setup`."""
