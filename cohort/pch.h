// The precompiled header every cohort target shares: LibTorch's front door
// costs ~20 s per translation unit without it.
#pragma once

#include <torch/torch.h>
