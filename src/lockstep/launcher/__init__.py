"""The ``lockstep`` launcher: argv + env -> LaunchPlan -> supervised worker processes."""
