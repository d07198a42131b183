// Moved to the public header include/pipewright/ops.h (temporary forwarding header; removed once
// the engine includes the public one).
#include "pipewright/ops.h"
