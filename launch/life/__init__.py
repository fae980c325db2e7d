"""A run's life: its record and the one writer of it (records), the ranks' output (stream), the store's part
(store_run), the one ending (lifecycle), detached runs (detach, head), resume, fab runs / logs / stop, the
clean-up sweep, the run lock and the watchdog."""
