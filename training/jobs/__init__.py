"""The bundled jobs (glue, qa, clm), their data and what they share. Imports runtime and speed, never launch."""
