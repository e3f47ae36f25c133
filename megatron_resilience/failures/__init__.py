"""What can end an attempt: the error types and each one's facts, said once.

- :mod:`.taxonomy`  the error types: retry mode (crash / stall / timeout), subsystem, hardware or not, and the
  other facts the classifier, the policies and the node attribution read from the type;
- :mod:`.xid_codes` NVIDIA Xid codes by number and what each says about the GPU;
- :mod:`.foreign_vocabulary` the log-monitoring tool's error types and subsystems, and what each means here.

Plain data, stdlib only: the job-level room classifies and decides with it, chaos names what it injects in it,
the plugins check a policy file against it before submission.
"""
