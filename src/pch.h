// Precompiled header for translation units that use LibTorch: <torch/torch.h> alone costs ~20 s per TU.
#pragma once
#include <torch/torch.h>
