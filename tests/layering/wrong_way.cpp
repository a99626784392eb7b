// Compiled against dcp_plan only (tests/CMakeLists.txt, layering_wrong_way_include): plan is torch-free and
// below the model, so the model's header must not be found. The build of this file must fail.
#include "dcp/model.h"

int main() { return 0; }
