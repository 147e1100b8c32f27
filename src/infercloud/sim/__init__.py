"""The digital twin: the platform's own policies (engine scheduler, block pool, prefix cache and
eviction, router, admission) driven by simulated time and a performance model instead of a model
runner, for fleets and traffic this machine cannot run (`infercloud simulate`)."""
