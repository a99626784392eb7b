#include "train/data_fingerprint.h"

#include <fmt/format.h>

namespace dcp {

std::string corpus_fingerprint(const Corpus& corpus) {
  std::string listing;
  int64_t tokens = 0;
  for (const Sample& s : corpus.samples()) {
    listing += fmt::format("{}\n{}\n", s.source, s.length);
    tokens += s.length;
  }
  return fmt::format("{} documents, {} samples, {} tokens, fnv1a64 {:016x}", corpus.num_documents(),
                     corpus.samples().size(), tokens, fnv1a64(listing));
}

}  // namespace dcp
