"""The built-in detectors, registered in the order they run.

crash before hang (a hang whose culprit is silent is the crash), nan before the
spikes, the loss spike before the grad-norm spike (which folds into it).
"""

# the order of these imports is the order the detectors run in
# isort: off
from analysis.detectors import crash, hang, nan, spikes, loss_scale, straggler, slow_link, device_health  # noqa: F401
from analysis.detectors import data_stall, checkpoint_slow  # noqa: F401
from analysis.detectors import replica_divergence, node_history, preflight  # noqa: F401
# isort: on
