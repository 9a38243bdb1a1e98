"""The data a run reads and writes, without torch: token files, which tokens each sample
reads, the identity of the file a run checked, the tiny corpus, and metrics files."""
