// The registry of live temporary outputs and the watcher thread that removes them on SIGINT or
// SIGTERM (interrupt.h).
#include "ucp/io/interrupt.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace ucp::io {
namespace fs = std::filesystem;

namespace {

struct Registry {
  std::mutex mu;
  std::set<std::string> paths;  // guarded by mu
  std::string label = "ucp";    // guarded by mu
  bool speaks = true;           // guarded by mu
  bool terminal = false;        // guarded by mu
  bool started = false;         // guarded by mu
};

Registry& Reg() {
  // Never destroyed: the watcher thread may use it while static destructors run at exit.
  static Registry* r = new Registry();
  return *r;
}

// Removes one temporary path; true when it is gone afterwards. A folder is first renamed to a
// private name: the rename is atomic, so when another process (an MPI peer signalled at the same
// moment) or a committing thread renames it first, this one sees ENOENT and touches nothing; and
// worker threads that still write into the folder by path can no longer add to the tree being
// removed.
bool RemoveOne(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return true;
  if (!S_ISDIR(st.st_mode)) return ::unlink(path.c_str()) == 0 || errno == ENOENT;
  const std::string claimed = path + ".removing-" + std::to_string(::getpid());
  if (::rename(path.c_str(), claimed.c_str()) != 0) return errno == ENOENT;
  std::error_code ec;
  // A worker that opened a path inside just before the rename may still create an entry; a
  // few passes see the tree empty.
  for (int pass = 0; pass < 50; ++pass) {
    fs::remove_all(claimed, ec);
    if (!fs::exists(fs::symlink_status(claimed, ec))) return true;
    ::usleep(2000);
  }
  return false;
}

// Removes every recorded path; the caller holds the registry's lock (the watcher never gives it
// back: the process is about to exit, and a thread that would record a new temporary waits).
// Returns the paths now gone and those that could not be removed. A recorded path is a live
// temporary (committing or removing one forgets it), so one gone now was removed by this
// process or by an MPI peer signalled at the same time.
void RemoveAll(const std::unique_lock<std::mutex>& lock, std::vector<std::string>& removed,
               std::vector<std::string>& left) {
  (void)lock;
  for (const std::string& p : Reg().paths) (RemoveOne(p) ? removed : left).push_back(p);
  Reg().paths.clear();
}

void WriteStderr(const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(STDERR_FILENO, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

std::string Join(const std::vector<std::string>& v) {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

// The write end of the pipe the signal handler writes the signal's number to.
int g_signal_pipe = -1;

// The whole handler: one async-signal-safe write. The watcher thread does the work.
void OnSignal(int signo) {
  const int saved = errno;
  const unsigned char c = static_cast<unsigned char>(signo);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe, &c, 1);
  errno = saved;
}

[[noreturn]] void Watch(sigset_t set, int read_fd) {
  // This thread takes the signals (every thread created after StartInterruptWatcher blocks
  // them); a thread that existed before (a BLAS pool a library started while loading) may take
  // one too: the handler only writes to the pipe either way.
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  unsigned char c = 0;
  while (true) {
    const ssize_t n = ::read(read_fd, &c, 1);
    if (n == 1) break;
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) ::pause();  // the pipe failed: no cleanup possible, the signal's default waits
  }
  const int signo = c;
  Registry& r = Reg();
  std::unique_lock<std::mutex> lock(r.mu);
  std::vector<std::string> removed, left;
  RemoveAll(lock, removed, left);
  if (r.speaks) {
    std::string line = r.terminal ? "\n" : "";
    line += r.label + ": interrupted by " + (signo == SIGINT ? "SIGINT" : "SIGTERM") + "; ";
    if (removed.empty() && left.empty()) {
      line += "no temporary output to remove";
    } else if (!removed.empty()) {
      line += "removed the temporary output " + Join(removed);
    }
    if (!left.empty()) {
      line += (removed.empty() ? "" : "; ") + std::string("could not remove ") + Join(left);
    }
    line += "; exit " + std::to_string(InterruptExitCode(signo)) + "\n";
    WriteStderr(line);
  }
  // No destructors, no atexit handlers (HDF5's would flush files whose folder is gone), no
  // MPI_Finalize (the launcher sees the exit code and ends the job).
  ::_exit(InterruptExitCode(signo));
}

}  // namespace

void RegisterTempPath(const fs::path& path) {
  std::lock_guard<std::mutex> lock(Reg().mu);
  Reg().paths.insert(path.string());
}

int CreateRegisteredTempPath(std::string& templ, const std::function<int(std::string&)>& create) {
  std::lock_guard<std::mutex> lock(Reg().mu);
  const int err = create(templ);
  if (err == 0) Reg().paths.insert(templ);
  return err;
}

void UnregisterTempPath(const fs::path& path) {
  std::lock_guard<std::mutex> lock(Reg().mu);
  Reg().paths.erase(path.string());
}

void StartInterruptWatcher(const std::string& program) {
  Registry& r = Reg();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.started) return;
    r.started = true;
    r.label = program;
  }
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return;  // no watcher: the signals keep their default
  g_signal_pipe = fds[1];
  sigset_t set;
  sigemptyset(&set);
  for (int signo : {SIGINT, SIGTERM}) {
    struct sigaction old;
    if (::sigaction(signo, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_handler = OnSignal;
    sa.sa_flags = SA_RESTART;  // other threads' system calls resume rather than fail with EINTR
    sigfillset(&sa.sa_mask);
    if (::sigaction(signo, &sa, nullptr) == 0) sigaddset(&set, signo);
  }
  // Blocked here, so in every thread created from now on.
  ::pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread(Watch, set, fds[0]).detach();
}

void SetInterruptContext(const std::string& label, bool speaks, bool terminal) {
  std::lock_guard<std::mutex> lock(Reg().mu);
  Reg().label = label;
  Reg().speaks = speaks;
  Reg().terminal = terminal;
}

int RemoveRegisteredTempPathsForTest() {
  std::unique_lock<std::mutex> lock(Reg().mu);
  std::vector<std::string> removed, left;
  RemoveAll(lock, removed, left);
  return static_cast<int>(removed.size());
}

}  // namespace ucp::io
