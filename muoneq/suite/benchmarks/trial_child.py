"""The traced trial of ``muoneq bench-trial`` run as a module
(``python -m muoneq.suite.benchmarks.trial_child OUT ARGS…``), which a warm server forks
(:mod:`muoneq.suite.sweeps.warm`): its clock is read as its code starts
(:func:`muoneq.suite.benchmarks.bench_trial.traced_trial`)."""

import time

started = time.time()

if __name__ == "__main__":
    from muoneq.suite.benchmarks.bench_trial import traced_trial

    traced_trial(started)
