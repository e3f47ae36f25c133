"""Goodput arithmetic shared by the report (login node) and the trainer (compute node): stdlib only.

:mod:`.daly` holds Young's and Daly's optimum checkpoint interval and the expected efficiency of an
interval; :mod:`.history` reads a run's checkpoint cost and failure rate from its own records.
"""
