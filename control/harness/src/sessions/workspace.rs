//! A session's files beyond its sandbox's life: suspended beside its log,
//! exported, diffed, and copied into a fork.

use super::*;

impl Sessions {
    /// Where a service that hosts the session (`corral serve`) keeps the
    /// JSON events of its runs: beside its log (not a `.jsonl`, so not
    /// listed as a session).
    pub fn events_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.events"))
    }

    /// Where a suspended session's workspace is kept: beside its log.
    pub fn saved_workspace(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.workspace.tar"))
    }

    /// Suspends a stored session that is not running (its log is held):
    /// its /workspace is saved beside its log and its sandbox removed from
    /// `worker`, so it holds no process, memory or disk there; a resume
    /// brings the files back in a new sandbox (processes it had started do
    /// not come back). Returns the bytes saved, or `None` when its sandbox
    /// was gone already.
    pub async fn suspend<W: WorkerApi>(
        &self,
        stored: &Stored,
        worker: W,
    ) -> Result<Option<u64>, SessionError> {
        let Some(config) = stored.config() else {
            return Ok(None);
        };
        let sandbox = &config.sandbox_id;
        match worker.get_sandbox(sandbox).await {
            Ok(_) => {}
            Err(ApiError::NotFound(_)) => return Ok(None),
            Err(e) => return Err(sandbox_error(sandbox, e)),
        }
        let saved = self.saved_workspace(stored.id());
        let moved = crate::transfer::save_contents(&worker, sandbox, WORKSPACE, &saved)
            .await
            .map_err(|e| SessionError::Sandbox {
                sandbox: sandbox.clone(),
                error: format!("saving its workspace: {e}"),
                why: None,
            })?;
        match worker.destroy_sandbox(sandbox).await {
            Ok(_) | Err(ApiError::NotFound(_)) => Ok(Some(moved.bytes)),
            Err(e) => Err(sandbox_error(sandbox, e)),
        }
    }

    /// Forks `parent` into `child` at a turn boundary (see `fork`); the
    /// child gets a new sandbox when it first runs, empty.
    pub fn fork(&self, parent: &str, child: &str, turn: Option<u64>) -> Result<(), SessionError> {
        fork(&self.dir, parent, child, turn, self.clock.clone())
    }

    /// Forks `parent` into `child` (see `fork`) and gives the child its
    /// sandbox now, on `worker` (the parent's), with a copy of the parent's
    /// workspace as it is: a live fork of the parent's sandbox (its
    /// /workspace and /tmp at one instant, made on the worker's host) when
    /// the worker can make one, else the workspace copied through this
    /// process, or restored from a suspended parent's saved copy. A parent
    /// whose sandbox is gone leaves the child an empty one (`Ok(false)`).
    /// If the copy fails, the fork is undone.
    pub async fn fork_with_workspace<W: WorkerApi>(
        &self,
        parent: &str,
        child: &str,
        turn: Option<u64>,
        worker: W,
        telemetry: Option<&crate::telemetry::Telemetry>,
    ) -> Result<bool, SessionError> {
        let mut trace =
            telemetry.map(|t| crate::telemetry::ForkTrace::start(t, parent, child, turn));
        let forked = self
            .fork_copying(parent, child, turn, worker, trace.as_mut())
            .await;
        if let (Some(t), Err(e)) = (&mut trace, &forked) {
            t.failed(&e.to_string());
        }
        forked
    }

    async fn fork_copying<W: WorkerApi>(
        &self,
        parent: &str,
        child: &str,
        turn: Option<u64>,
        worker: W,
        mut trace: Option<&mut crate::telemetry::ForkTrace>,
    ) -> Result<bool, SessionError> {
        let mut note = |name: &'static str, attrs: Vec<opentelemetry::KeyValue>| {
            if let Some(t) = trace.as_mut() {
                t.note(name, attrs);
            }
        };
        fork(&self.dir, parent, child, turn, self.clock.clone())?;
        note("log_forked", vec![]);
        let undo = |e: SessionError| {
            let _ = std::fs::remove_file(crate::session::log::path_of(&self.dir, child));
            e
        };
        let (from, to) = match (self.config_of(parent), self.config_of(child)) {
            (Ok(p), Ok(c)) => (p, c),
            (Err(e), _) | (_, Err(e)) => return Err(undo(e)),
        };
        let saved = self.saved_workspace(parent);
        let live = match worker.get_sandbox(&from.sandbox_id).await {
            Ok(info) => Some(info),
            Err(ApiError::NotFound(_)) => None,
            // Not knowing is not "gone": no fork with an empty workspace.
            Err(e) => return Err(undo(sandbox_error(&from.sandbox_id, e))),
        };
        // A live parent whose child is to be like it: the worker forks it,
        // its /workspace and /tmp at one instant, on its own host.
        if let Some(info) = &live
            && info.spec == sandbox_spec(&to)
        {
            match worker.fork_sandbox(&from.sandbox_id, &to.sandbox_id).await {
                Ok(Some(frozen)) => {
                    tracing::info!(sandbox = %to.sandbox_id, parent = %from.sandbox_id, frozen_ms = frozen.as_secs_f64() * 1000.0, "the parent's sandbox forked");
                    note(
                        "sandbox_forked",
                        vec![
                            opentelemetry::KeyValue::new(
                                "corral.sandbox.id",
                                to.sandbox_id.to_string(),
                            ),
                            opentelemetry::KeyValue::new(
                                "corral.fork.frozen_ms",
                                frozen.as_millis() as i64,
                            ),
                        ],
                    );
                    return Ok(true);
                }
                Ok(None) => {
                    tracing::debug!(sandbox = %from.sandbox_id, "the worker cannot fork this sandbox; copying its workspace")
                }
                Err(e) => return Err(undo(sandbox_error(&to.sandbox_id, e))),
            }
        }
        let live = live.is_some();
        if !live && !saved.exists() {
            tracing::warn!(sandbox = %from.sandbox_id, "the parent's sandbox is gone; the fork starts with an empty workspace");
            note("empty_workspace", vec![]);
            return Ok(false);
        }
        let made = create(&worker, &to.sandbox_id, &sandbox_spec(&to), None).await;
        if let Err(e) = made {
            return Err(undo(e));
        }
        let copied = if live {
            crate::transfer::copy_contents(
                (&worker, &from.sandbox_id, WORKSPACE),
                (&worker, &to.sandbox_id, WORKSPACE),
            )
            .await
        } else {
            // A suspended parent: its saved workspace.
            crate::transfer::restore_contents(&worker, &to.sandbox_id, &saved, WORKSPACE).await
        };
        if let Err(e) = copied {
            let _ = worker.destroy_sandbox(&to.sandbox_id).await;
            return Err(undo(SessionError::Upload {
                path: format!("{parent}'s workspace"),
                error: e.to_string(),
            }));
        }
        note(
            if live {
                "workspace_copied"
            } else {
                "workspace_restored"
            },
            vec![opentelemetry::KeyValue::new(
                "corral.sandbox.id",
                to.sandbox_id.to_string(),
            )],
        );
        Ok(true)
    }

    /// Writes the changes made to the session's /workspace, a git
    /// repository, as a patch to the local file `dest`: everything against
    /// its HEAD (an empty tree before the first commit), new files
    /// included, binary-safe, so that `git apply` on the original gives
    /// the session's files. The repository's own index is left alone.
    pub async fn export_diff<W: WorkerApi>(
        &self,
        id: &str,
        worker: W,
        dest: &Path,
    ) -> Result<crate::transfer::Moved, SessionError> {
        self.export_diff_with(id, worker, dest, None).await
    }

    /// [`Self::export_diff`], with what `-` writes to (stdout if `None`):
    /// a terminal's caller passes a writer that makes the patch's control
    /// characters visible.
    pub async fn export_diff_with<W: WorkerApi>(
        &self,
        id: &str,
        worker: W,
        dest: &Path,
        stdout: Option<Box<dyn tokio::io::AsyncWrite + Unpin + Send>>,
    ) -> Result<crate::transfer::Moved, SessionError> {
        let config = self.config_of(id)?;
        let saved = self.saved_workspace(id);
        // A suspended session's files are brought up in a sandbox of their
        // own for as long as it takes.
        let temporary = saved.exists().then(|| {
            SandboxId::new(format!("{}-diff", config.sandbox_id))
                .unwrap_or_else(|_| SandboxId::random())
        });
        let sandbox = temporary
            .clone()
            .unwrap_or_else(|| config.sandbox_id.clone());
        if temporary.is_some() {
            create(&worker, &sandbox, &sandbox_spec(&config), None).await?;
            if let Err(e) =
                crate::transfer::restore_contents(&worker, &sandbox, &saved, WORKSPACE).await
            {
                let _ = worker.destroy_sandbox(&sandbox).await;
                return Err(SessionError::Upload {
                    path: saved.display().to_string(),
                    error: e.to_string(),
                });
            }
        }
        // `-` is stdout (a patch for a pipe), never a file named `-`.
        let to_stdout = dest.as_os_str() == "-";
        let file: Result<Box<dyn tokio::io::AsyncWrite + Unpin + Send>, _> = if to_stdout {
            Ok(stdout.unwrap_or_else(|| Box::new(tokio::io::stdout())))
        } else {
            tokio::fs::File::create(dest)
                .await
                .map(|f| Box::new(f) as Box<dyn tokio::io::AsyncWrite + Unpin + Send>)
                .map_err(|e| SessionError::Invalid(format!("{}: {e}", dest.display())))
        };
        let written = match file {
            Ok(mut file) => {
                crate::transfer::stream_stdout(&worker, &sandbox, DIFF_COMMAND, &mut file).await
            }
            Err(e) => {
                if temporary.is_some() {
                    let _ = worker.destroy_sandbox(&sandbox).await;
                }
                return Err(e);
            }
        };
        if temporary.is_some() {
            let _ = worker.destroy_sandbox(&sandbox).await;
        }
        written.map_err(|e| {
            if !to_stdout {
                let _ = std::fs::remove_file(dest);
            }
            match e {
                crate::transfer::TransferError::Exited { code, said } if code == NO_DIFF => {
                    SessionError::Invalid(said)
                }
                e => SessionError::Sandbox {
                    sandbox,
                    error: e.to_string(),
                    why: None,
                },
            }
        })
    }

    /// Copies the session's /workspace into the local directory `dest`
    /// (made if missing), from `worker` (the one it was placed on). A
    /// running session may be exported: what it has written so far comes.
    ///
    /// What comes is the sandbox's, so hostile: `rules` (usually
    /// [`Unpacking::contents_from_sandbox`](crate::transfer::Unpacking::contents_from_sandbox))
    /// bound it, and the notes of the result say what was left out.
    pub async fn export<W: WorkerApi>(
        &self,
        id: &str,
        worker: W,
        dest: &Path,
        rules: crate::transfer::Unpacking,
    ) -> Result<crate::transfer::Moved, SessionError> {
        let config = self.config_of(id)?;
        let saved = self.saved_workspace(id);
        if saved.exists() {
            // Suspended: the files are here already.
            return crate::transfer::unpack_saved(&saved, dest, rules)
                .await
                .map_err(|e| SessionError::Invalid(e.to_string()));
        }
        crate::transfer::download_contents(
            &worker,
            &config.sandbox_id,
            WORKSPACE,
            dest,
            rules,
            |_| {},
        )
        .await
        .map_err(|e| SessionError::Sandbox {
            sandbox: config.sandbox_id.clone(),
            error: e.to_string(),
            why: None,
        })
    }
}
