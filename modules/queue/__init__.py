"""A queue of training jobs over one machine's GPUs (see docs/Queue.md).

    jobs.py        a job and the GPUs it needs (a count, named devices, or all), as the queue file keeps them
    scheduler.py   pure decisions over the queue: which jobs start on which GPUs now, what an ended run makes
                   of its job, reordering - no files, no processes
    store.py       the queue file in Tandem's home: one lock, atomic writes, private to the user
    actions.py     add (with the refusal of a job larger than the machine), cancel, move, pause, resume
    launch.py      what a job runs on the GPUs it was given: its config, command line and environment
    log_summary.py a run's log read for the queue's view: progress, ETA, the model, the error
    view.py        one row per job as `list`, the GUI and a remote queue's answer show it
    runner.py      the one detached process per queue file that starts jobs as their GPUs free up
    cli.py         scripts/train_queue.py
    remote.py      the same queue on a remote machine: its runner and jobs run there

Jobs run detached, as remote runs do (`modules/remote/remote_side.py`'s supervised runs, here on this
machine): a job outlives the runner, the GUI and the terminal that queued it. Torch-free; the runner counts
GPUs with torch only when no slot count was set.
"""
