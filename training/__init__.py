"""The bundled distributed jobs and the pieces they share (rank set-up, backend, precision)."""
