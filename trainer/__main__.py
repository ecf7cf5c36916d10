import sys

from trainer.cli import main
from trainer.launch import under_torchrun
from trainer.lifeline import exit_now

code = main()
if under_torchrun():  # this process was a rank (torch imported): it ends without torch's teardown
    exit_now(code)
sys.exit(code)
