"""A run's life: its record and the one writer of it (records), the one ending (lifecycle), detached runs
(detach), the supervisor that restarts preempted runs (supervisor, restarts, resume), fab runs / logs / stop,
the clean-up sweep, the run lock and the watchdog."""
