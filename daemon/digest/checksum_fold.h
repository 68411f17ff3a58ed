#pragma once
// weightbridged's rule for host_tcp's per-batch checksums next to end-to-end digests (docs/daemon.md
// "End-to-end digests", "Per-batch checksums folded in"): the digests check every op's landed bytes
// against what its source read, which covers the wire, so the per-batch xxh3 is off while digests
// are on and on with --digests=false; a --checksums / --nochecksums / --checksums=... given on the
// command line always wins. Pure: argv in, a bool out.

namespace wb::digest {

// True when argv[1..] (up to a "--") sets the checksums flag: --checksums, --nochecksums,
// --checksums=..., or the same with one dash.
bool ChecksumsGiven(int argc, char** argv);

// Whether the node checksums host_tcp batches: `checksums_flag` (the flag's value) when the command
// line gave it, else !digests.
bool ChecksumsOn(int argc, char** argv, bool digests, bool checksums_flag);

}  // namespace wb::digest
