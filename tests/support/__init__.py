"""What the test modules share that is not a test: the rank launcher helpers (ranks), the fault campaign (faults),
checkpoint mutations (mutations), a local Hub server (hub_server), and the workers the tests start under torchrun
(`python -m tests.support.reshard_worker ...`, through fixtures.build.ds_launch)."""
