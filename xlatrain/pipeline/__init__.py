"""Pipeline parallelism as data: schedules (tables of time slot x stage -> action), the slot programs made from
them, the block partition, the stage layout of the parameters, the remat choice and the plan of a run. Their
lowered programs are lowering/pipeline/."""
