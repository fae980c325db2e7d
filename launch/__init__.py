"""`fab train`, in three rooms and one conductor: plan/ (flags -> request -> mpirun), ship/ (code, data and
secrets out; output, checkpoints and records back), life/ (a run's record, its ending, detached runs, restarts
and the supervisor). run.py stages, runs mpirun and hands what it saw to life.lifecycle.end."""
