"""The ``netoptim`` command's core subcommands: ``node``, ``demo``, ``admin``, ``plan``, ``cluster``
and the flag types they share. :mod:`netoptim.console` assembles them with ``bench`` (which lives
with the benchmarks, above this package: nothing here imports :mod:`netoptim.benchmarks`)."""
