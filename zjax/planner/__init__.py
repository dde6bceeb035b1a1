"""Plan before you rent: per-device memory and communication from ahead-of-time compiles."""

from ._analytic import zero_bytes as zero_bytes
from ._compile import partitioned_hlo as partitioned_hlo
from ._estimate import estimate as estimate
from ._estimate import estimate_fn as estimate_fn
from ._fit import Candidate as Candidate
from ._fit import Fit as Fit
from ._fit import describe_skipped as describe_skipped
from ._fit import fit as fit
from ._gemms import count_gemms as count_gemms
from ._hlo import Communication as Communication
from ._hlo import count_collectives as count_collectives
from ._models import resolve_model as resolve_model
from ._result import Estimate as Estimate
from ._result import Row as Row
