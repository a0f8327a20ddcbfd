// On a crash (SIGSEGV, SIGBUS, SIGFPE, SIGABRT) the GPU tests print the stack's return addresses
// before dying: they run on machines without a debugger, and `addr2line -e shadowkv_gpu_tests`
// on the printed offsets names the frames.
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <initializer_list>

namespace {

void PrintBacktrace(int signal_number) {
  constexpr char kHeader[] = "\n*** crash: stack (addr2line -e shadowkv_gpu_tests OFFSET):\n";
  (void)!write(STDERR_FILENO, kHeader, sizeof(kHeader) - 1);
  void* frames[64];
  const int count = backtrace(frames, 64);
  backtrace_symbols_fd(frames, count, STDERR_FILENO);
  signal(signal_number, SIG_DFL);
  raise(signal_number);
}

const bool kInstalled = [] {
  for (int s : {SIGSEGV, SIGBUS, SIGFPE, SIGABRT}) signal(s, PrintBacktrace);
  return true;
}();

}  // namespace
