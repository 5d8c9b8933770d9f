"""Local processes of a job: nodes and workers started, watched and stopped on this machine."""
