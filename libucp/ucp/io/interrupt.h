// What an interrupted run leaves behind: nothing. Every temporary output ucp creates (the
// `DST.tmp-XXXXXX` folder of a checkpoint, the `.name.tmp-XXXXXX` file of an atomic write) is
// recorded here from its creation until it is committed (renamed into place) or removed. A tool
// that calls StartInterruptWatcher first thing in main() then handles SIGINT and SIGTERM by
// removing every recorded path and exiting with 128 + the signal's number (130, 143: the shell's
// convention; docs/errors.md).
//
// The signals are blocked in the thread that starts the watcher, hence in every thread created
// later (TBB's, MPI's); the watcher thread unblocks them, so the kernel delivers them to it (or
// to a thread a library started before main(), a BLAS pool). The handler only writes the
// signal's number to a pipe (async-signal-safe); the watcher reads it and does the cleanup as
// ordinary code (locks, std::filesystem).
#pragma once

#include <filesystem>
#include <functional>
#include <string>

namespace ucp::io {

/// Records `path` (a temporary folder or file) as this process's to remove on SIGINT/SIGTERM.
/// MakeTempSiblingDir and WriteFileAtomic call it; a process joining a folder another process
/// created (the non-root processes of an MPI run) records it too, so that whichever process is
/// signalled first removes it.
void RegisterTempPath(const std::filesystem::path& path);

/// Creates a temporary path and records it as one step for the watcher: `create` (mkdtemp or
/// mkstemp on `templ`) runs under the registry's lock, so a signal's cleanup runs wholly before
/// it (the process then exits before the path exists) or after it (and removes it); creating
/// first and recording after would leave a window in which a signal finds nothing to remove and
/// the new path stays behind. `create` returns 0, or the errno of its failure (then nothing is
/// recorded), which this returns.
int CreateRegisteredTempPath(std::string& templ, const std::function<int(std::string&)>& create);

/// Forgets `path` (it was committed or removed). Unknown paths are ignored.
void UnregisterTempPath(const std::filesystem::path& path);

/// Installs the SIGINT and SIGTERM handler, blocks both in the calling thread and starts the
/// watcher thread. Call it at the start of main(), before the program starts threads. A signal
/// whose disposition is
/// SIG_IGN when this is called (a background job of a non-interactive shell, nohup) stays
/// ignored. `program` names the tool in the message ("ucp", "ucp-train"). Idempotent.
void StartInterruptWatcher(const std::string& program);

/// What the message says once the command is known: `label` ("ucp convert"), and whether this
/// process prints it (`speaks`: the root of an MPI job; the others stay silent) and whether
/// stderr holds a progress bar to end first (`terminal`).
void SetInterruptContext(const std::string& label, bool speaks, bool terminal);

/// The exit code for a run stopped by signal `signo`: 128 + signo.
constexpr int InterruptExitCode(int signo) { return 128 + signo; }

/// Removes every recorded path now, as the watcher does on a signal, and returns how many are
/// gone (test hook; the watcher's own code). Each folder is first renamed to
/// a private name, so it is removed by exactly one process and a commit that renames it away at
/// the same time either wins (the output is complete) or fails (nothing is left).
int RemoveRegisteredTempPathsForTest();

}  // namespace ucp::io
