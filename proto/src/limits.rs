//! Hard limits, shared by the worker, the supervisor and the clients.

/// Largest frame on the worker <-> corral-init link.
pub const MAX_FRAME_BYTES: usize = 32 << 20;
/// Largest gRPC message either side accepts.
pub const MAX_GRPC_MESSAGE_BYTES: usize = 40 << 20;
/// Largest request the worker accepts: one write_file's data, its path,
/// and room for a command and environment at their limits besides. What
/// one connection can make the worker hold while it decodes.
pub const MAX_REQUEST_BYTES: usize = MAX_FILE_BYTES as usize + (3 << 20);
/// Most bytes of finished operations (commands, write data, captured
/// output: [`crate::init::OperationRecord::weight`]) the supervisor and the
/// worker remember per sandbox; the oldest are forgotten past it.
pub const MAX_FINISHED_BYTES: usize = 64 << 20;
/// About how many bytes of operations one ListOperations page carries.
pub const LIST_PAGE_BYTES: usize = 4 << 20;
/// Largest shell command text.
pub const MAX_COMMAND_BYTES: usize = 1 << 20;
/// Largest file a single read_file returns, or write_file carries, in one
/// message (streamed ones have no limit of their own).
pub const MAX_FILE_BYTES: u64 = 8 << 20;
/// Largest chunk of one WriteInput call (and one input frame).
pub const MAX_INPUT_CHUNK_BYTES: usize = 1 << 20;
/// Default bytes of each output stream kept in a result (head + tail).
pub const DEFAULT_OUTPUT_LIMIT_BYTES: u64 = 1 << 20;
/// Largest `output_limit_bytes` a shell operation may ask for.
pub const MAX_OUTPUT_LIMIT_BYTES: u64 = 8 << 20;
/// Default shell timeout.
pub const DEFAULT_TIMEOUT_MS: u64 = 10 * 60 * 1000;
/// Longest shell timeout.
pub const MAX_TIMEOUT_MS: u64 = 24 * 60 * 60 * 1000;
/// Most environment entries on one operation or sandbox.
pub const MAX_ENV_ENTRIES: usize = 256;
/// Longest `KEY=VALUE` of an environment: the kernel refuses an `execve`
/// with a longer string (MAX_ARG_STRLEN, 128 KiB with its NUL).
pub const MAX_ENV_ENTRY_BYTES: usize = 128 * 1024 - 1;
/// Most bytes of an environment in all.
pub const MAX_ENV_BYTES: usize = 1024 * 1024;
/// Longest path accepted by file operations.
pub const MAX_PATH_BYTES: usize = 4096;
/// Where the writable workspace is mounted in every sandbox.
pub const WORKSPACE_DIR: &str = "/workspace";
/// Where the tmpfs scratch directory is mounted in every sandbox.
pub const TMP_DIR: &str = "/tmp";
/// Labels a sandbox may carry, and the size of each key and value.
pub const MAX_LABELS: usize = 64;
pub const MAX_LABEL_KEY_BYTES: usize = 128;
pub const MAX_LABEL_VALUE_BYTES: usize = 1024;
/// Most children one fork makes.
pub const MAX_FORK_CHILDREN: usize = 100;
