"""What a rank tells planc run's launcher, besides its output: files in the rank's log
directory (``BUILD/logs/RUN_ID/RANK/``) and its exit status. Shared by the launcher
(planc.runtime.launcher.launch, which imports torch only to count GPUs) and the worker."""

EXIT_HANG = 3  # the rank reported what its streams wait for, then left
ERROR_FILE = "error.txt"  # the traceback of a rank that failed
REPORT_FILE = "hang.txt"  # what the rank's streams wait for, once it stopped progressing
TRAINING_FILE = "training"  # the rank has started its first step
STEPS_FILE = "steps"  # the leader's count of steps finished, rewritten after each
# where in the rank's stderr.log its report of a lost peer begins (a byte offset), written
# before the report: a peer's failure is the cause, the launcher shows the report only
# when no rank failed by itself
LOST_PEER_FILE = "lost-peer"
