"""Many streams on one device loop: stream state, the runner, the scheduler, admission, handles."""
