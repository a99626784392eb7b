// The web page of GET /: a prompt box, policy and budget selectors, the streamed output and the bytes the
// session's KV cache holds. One HTML file with its script and style inline: no external assets.
#pragma once

#include <string>
#include <vector>

namespace dcp::serve {

/// The page, with `policies` in its policy selector and `default_policy` selected.
std::string page_html(const std::vector<std::string>& policies, const std::string& default_policy, double default_budget,
                      const std::string& model_id);

}  // namespace dcp::serve
