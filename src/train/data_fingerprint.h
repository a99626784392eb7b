// What a checkpoint remembers of its corpus, so that a resume over a changed data.path is noticed: adding,
// removing or resizing a file changes the samples, their order and the held-out split.
#pragma once

#include <string>

#include "dcp/data.h"

namespace dcp {

/// "<documents> documents, <samples> samples, <tokens> tokens, fnv1a64 <hex>": the hash runs over every sample's
/// source ("path#chunk") and length in tokens, in corpus order: the same files with the same sizes (after
/// skipping and chunking) give the same fingerprint; a file's content edited in place at equal size does not
/// change it. Throws nothing.
std::string corpus_fingerprint(const Corpus& corpus);

}  // namespace dcp
