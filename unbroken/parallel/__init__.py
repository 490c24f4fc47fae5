"""Process groups that survive generations, for wrappers that keep their group (DDP, FSDP2, DTensor).

Standalone for now (phase 1 of issue 13): :class:`~unbroken.parallel.fabric.Fabric` owns one
job's groups in a process and moves them to each generation's gloo groups;
:class:`~unbroken.parallel.group.SurvivingGroup` is the ``ProcessGroup`` the wrappers hold;
:mod:`unbroken.parallel.ddp` keeps a stock DDP's reducer consistent across a switch. Not yet
wired into ``unbroken.init()``/``Job``: that waits for the recovery contract (issue r12).
"""
