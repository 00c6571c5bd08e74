// Stand-in for the CUDA header of this name when kernel sources are compiled for the CPU emulation (simt.h).
#pragma once
#include "../simt.h"
