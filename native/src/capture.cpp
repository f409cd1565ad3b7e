#include "tandem/capture.hpp"

#include <string>

#include "tandem/errors.hpp"

namespace tandem {

void Recording::add(const PreparedCall& call, const std::vector<RecordedRef>& refs) {
  if (refs.size() != call.tensors.size()) {
    throw InvalidArgument("recording: " + std::to_string(call.tensors.size()) + " tensors but " +
                          std::to_string(refs.size()) + " bases");
  }
  Task task;
  task.kernel = call.kernel;
  task.scalars = call.scalars;
  task.args.reserve(refs.size());
  size_t bases = bases_;
  for (size_t i = 0; i < refs.size(); ++i) {
    const TensorArg& t = call.tensors[i];
    const RecordedRef& r = refs[i];
    if (t.end > t.begin && t.begin < r.origin) {
      throw InvalidArgument("recording: tensor " + std::to_string(i) + " starts before its base");
    }
    Arg a;
    a.view = t.view;
    a.view.access = call.access[i];
    a.base = r.base;
    a.data_offset = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.view.data) - r.addr);
    a.begin = t.end > t.begin ? t.begin - r.origin : 0;
    a.end = t.end > t.begin ? t.end - r.origin : 0;
    task.args.push_back(a);
    if (static_cast<size_t>(r.base) + 1 > bases) bases = static_cast<size_t>(r.base) + 1;
  }
  tasks_.push_back(std::move(task));
  bases_ = bases;
}

}  // namespace tandem
