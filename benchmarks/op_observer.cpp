#include "benchmarks/op_observer.h"

#include <memory>

namespace shampoo::bench {
namespace {

struct ThreadState {
  int64_t top_level = 0;
  int64_t all = 0;
  int64_t depth = 0;
  bool by_name = false;
  std::string current;
  std::map<std::string, int64_t> names;
};

ThreadState& state() {
  thread_local ThreadState s;
  return s;
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  auto& s = state();
  if (s.depth == 0) {
    ++s.top_level;
    s.current = fn.name();
    if (s.by_name) ++s.names[s.current];
  }
  ++s.depth;
  ++s.all;
  return nullptr;
}

void on_end(const at::RecordFunction& /*fn*/, at::ObserverContext* /*ctx*/) {
  auto& s = state();
  if (--s.depth == 0) s.current.clear();
}

}  // namespace

OpObserver::OpObserver(bool by_name) {
  auto& s = state();
  s = ThreadState{};
  s.by_name = by_name;
  handle_ = at::addGlobalCallback(
      at::RecordFunctionCallback(&on_start, &on_end).scopes({at::RecordScope::FUNCTION}));
}

OpObserver::~OpObserver() {
  at::removeCallback(handle_);
  state().current.clear();
  state().depth = 0;
}

int64_t OpObserver::top_level() const { return state().top_level; }
int64_t OpObserver::all() const { return state().all; }
std::map<std::string, int64_t> OpObserver::top_level_by_name() const { return state().names; }
const std::string& OpObserver::current_op() { return state().current; }

}  // namespace shampoo::bench
