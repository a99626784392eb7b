// The web page of GET /: a prompt box, policy and budget selectors, the streamed output and the bytes the
// session's KV cache holds. One HTML file with its script and style inline: no external assets.
#pragma once

#include <string>
#include <vector>

namespace dcp::serve {

/// The page, with `policies` in its policy selector and `default_policy` selected; the budget selector starts at
/// `default_budget` (at 0.5 when that is 1, the budget of policy full, for a policy chosen later). `recurrent`: a
/// flexformer model, whose sessions hold recurrent states (the page says so where it shows the bytes held).
std::string page_html(const std::vector<std::string>& policies, const std::string& default_policy, double default_budget,
                      const std::string& model_id, bool recurrent = false);

}  // namespace dcp::serve
