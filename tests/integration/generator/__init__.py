"""A generator of user scripts and its driver (issue 32).

Each script is rendered as Python source from independent choices (:mod:`.render`): the wrapper,
the model, the data, the RNG seeding and the extras. The driver (:mod:`.driver`) writes it to a
temporary directory, runs it under `unbroken run` fault-free (once per combination, cached) and with
one fault sent from outside the job (SIGKILL or SIGSTOP of the worker of a RANK, at a moment read
from the script's own progress lines), and compares every rank's final weights bit for bit.

    python -m tests.integration.generator --seed 1 --count 60 --table   # the slow set as a table

Outcomes: ``pass`` (exit 0, bit-equal), ``refused`` (see :func:`.driver.refusal`), ``fail``
(anything else; exit 0 with different or missing weights is a fail, never a skip).
"""
