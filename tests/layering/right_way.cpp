// Compiled against dcp_plan only: its own header and those of the stages it links (data, util) are found.
#include "dcp/config.h"
#include "dcp/data.h"
#include "dcp/plan.h"
#include "plan/planner_common.h"

int main() { return dcp::StepPlan{}.groups.empty() ? 0 : 1; }
