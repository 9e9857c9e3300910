"""What keeps a run alive and observable: the launcher, faults and the watchdog, profiling,
garbage collection at known steps."""
