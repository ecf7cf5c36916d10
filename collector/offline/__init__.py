"""What runs on a file rather than on a live run: replay, postmortem, archive, retention."""
