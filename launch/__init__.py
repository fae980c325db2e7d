"""`fab train`, in four rooms and one conductor, imported one way (staging <- plan <- life <- run <- supervision):
staging/ (stage-in and stage-out: code, data and secrets out; outputs and checkpoints back), plan/ (request ->
mpirun), life/ (a run's record, its output stream and its one ending, detached runs), run.py (stages one run, runs
mpirun, hands what it saw to life.lifecycle.end) and supervision/ (flags resolved into a request, restarts and the
supervisor)."""
