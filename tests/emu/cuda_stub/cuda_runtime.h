// Stand-in for the CUDA header of this name when kernel sources are compiled for the CPU emulation (simt.h): the
// device surface, and the host runtime the launchers call (simt_runtime.h).
#pragma once
#include "../simt.h"
#include "../simt_runtime.h"
