//! How a session is made and set going: its settings, its sandbox (made,
//! named for its generation, tried again on transient failures), its skills
//! copied in, and the wiring of manager, model client and coordinator.

use super::*;

/// The id of a replacement sandbox: the first one's, with its generation
/// (`ID-g2`), within the id's length limit.
pub(super) fn next_generation(current: &SandboxId, generation: u64) -> SandboxId {
    let first = current.as_str();
    let first = match first.rsplit_once("-g") {
        Some((base, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => base,
        _ => first,
    };
    let suffix = format!("-g{generation}");
    let base: String = first.chars().take(64 - suffix.len()).collect();
    SandboxId::new(format!("{base}{suffix}")).unwrap_or_else(|_| SandboxId::random())
}

/// How long a sandbox's create is tried again after transient failures
/// (a connection that broke, a worker that blinked): creates are
/// idempotent by id. Past it, a caller with other workers places elsewhere.
pub(super) const CREATE_PATIENCE: Duration = Duration::from_secs(5);

/// Creates `sandbox` on `worker`, tried again as [`CREATE_PATIENCE`] says.
pub(super) async fn create<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    spec: &SandboxSpec,
    trace: Option<&crate::telemetry::RunTrace>,
) -> Result<corral_proto::SandboxInfo, SessionError> {
    let traceparent = trace.map(crate::telemetry::RunTrace::traceparent);
    crate::follow::retry(worker, CREATE_PATIENCE, || {
        worker.create_sandbox_traced(sandbox, spec, traceparent.as_deref())
    })
    .await
    .map_err(|e| match e {
        crate::follow::FollowError::Refused(e) => sandbox_error(sandbox, e),
        crate::follow::FollowError::GaveUp { last, .. } => {
            sandbox_error(sandbox, ApiError::Transient(last))
        }
    })
}

pub(super) fn sandbox_error(sandbox: &SandboxId, e: ApiError) -> SessionError {
    match e {
        // Full, draining, or not answering: another worker may do.
        ApiError::Refused(error, why) => SessionError::Refused {
            sandbox: sandbox.clone(),
            error,
            why,
        },
        ApiError::Transient(error) => SessionError::Refused {
            sandbox: sandbox.clone(),
            error,
            why: Why::new(Reason::NoWorker),
        },
        ApiError::Rejected(error, why) => SessionError::Sandbox {
            sandbox: sandbox.clone(),
            error,
            why,
        },
        ApiError::NotFound(error) => SessionError::Sandbox {
            sandbox: sandbox.clone(),
            error,
            why: Some(Why::new(Reason::SandboxNotFound)),
        },
    }
}

pub(super) fn check_key(endpoint: &Endpoint, key: &Option<String>) -> Result<(), SessionError> {
    if key.is_none() && endpoint.base_url.contains("api.openai.com") {
        return Err(SessionError::NoApiKey {
            base_url: endpoint.base_url.clone(),
        });
    }
    Ok(())
}

/// A tool choice that names a tool must name one the session offers.
pub(super) fn check_tool_choice(config: &SessionConfig) -> Result<(), SessionError> {
    let Some(ToolChoice::Tool(name)) = &config.tool_choice else {
        return Ok(());
    };
    let offered: Vec<String> = config
        .registry()
        .tools()
        .into_iter()
        .map(|t| t.name)
        .collect();
    if offered.contains(name) {
        return Ok(());
    }
    Err(SessionError::Invalid(format!(
        "--tool-choice {name}: the session offers no such tool (auto, required, none, or one of: {})",
        offered.join(", ")
    )))
}

/// Brings a suspended session's saved workspace into `sandbox`; a sandbox
/// left half restored is removed (the next try starts over).
pub(super) async fn restore_saved<W: WorkerApi>(
    worker: &W,
    sandbox: &SandboxId,
    saved: &std::path::Path,
) -> Result<(), SessionError> {
    let restored = crate::transfer::restore_contents(worker, sandbox, saved, WORKSPACE).await;
    if let Err(e) = restored {
        let _ = worker.destroy_sandbox(sandbox).await;
        return Err(SessionError::Upload {
            path: saved.display().to_string(),
            error: e.to_string(),
        });
    }
    Ok(())
}

/// What a resumed run changes of its session, from the request: what is
/// given replaces the session's from here on (recorded with the resume).
pub(super) fn overrides_of(opts: &RunOptions) -> Overrides {
    let req = &opts.request;
    Overrides {
        max_turns: req.limits.max_turns,
        model: req.model.clone(),
        base_url: opts.base_url.clone(),
        api: opts.api,
        tool_choice: req.tool_choice.as_deref().map(ToolChoice::parse),
        context_window_tokens: req.limits.context_window_tokens,
        max_output_tokens: req.limits.max_output_tokens,
        reasoning_effort: opts
            .reasoning_effort
            .clone()
            .or_else(|| req.reasoning_effort.map(|e| e.as_str().to_string())),
    }
}

/// The sandbox a session's config asks for (each generation's).
pub fn sandbox_spec(config: &SessionConfig) -> SandboxSpec {
    let labels = config
        .tenant
        .iter()
        .map(|t| (corral_proto::sandbox::TENANT_LABEL.to_string(), t.clone()))
        .collect();
    SandboxSpec {
        labels,
        image: config.image.clone(),
        template: config.template.clone(),
        idle_timeout_ms: Some(SANDBOX_IDLE_TIMEOUT.as_millis() as u64),
        // Checked when the session was made; a rule this build cannot read
        // (a log from elsewhere) is left out: narrower, never wider.
        egress: config
            .egress
            .iter()
            .filter_map(|r| r.parse().ok())
            .collect(),
        ..SandboxSpec::default()
    }
}

/// The settings of a new session: the request (with what the caller put
/// over it), then defaults.
pub(super) fn new_config(
    opts: &RunOptions,
    id: &str,
    endpoint: Endpoint,
    skills: &[Skill],
) -> SessionConfig {
    let req = &opts.request;
    let budget = Budget {
        context_window_tokens: req
            .limits
            .context_window_tokens
            .unwrap_or(Budget::default().context_window_tokens),
        max_tool_result_chars: req
            .limits
            .max_tool_result_chars
            .unwrap_or(Budget::default().max_tool_result_chars),
        // What the answer may take, when the request bounds it.
        reserve_output_tokens: req
            .limits
            .max_output_tokens
            .map_or(Budget::default().reserve_output_tokens, u64::from),
    };
    SessionConfig {
        model: req
            .model
            .clone()
            .unwrap_or_else(|| DEFAULT_MODEL.to_string()),
        system_prompt: req
            .system_prompt
            .clone()
            .unwrap_or_else(|| crate::context::DEFAULT_SYSTEM_PROMPT.trim_end().to_string()),
        tools: req.tools.clone(),
        sandbox_id: SandboxId::new(format!(
            "{}-{}",
            id.chars().take(40).collect::<String>(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ))
        .unwrap_or_else(|_| SandboxId::random()),
        image: opts.image.clone(),
        template: opts.template.clone(),
        budget,
        max_output_tokens: req.limits.max_output_tokens,
        reasoning_effort: opts
            .reasoning_effort
            .clone()
            .or_else(|| req.reasoning_effort.map(|e| e.as_str().to_string())),
        max_turns: req.limits.max_turns.unwrap_or(DEFAULT_MAX_TURNS),
        skills: skills.iter().map(SkillDef::from_skill).collect(),
        worker: None,
        endpoint: Some(endpoint),
        tool_choice: req.tool_choice.as_deref().map(ToolChoice::parse),
        keep_tool_choice: req.keep_tool_choice,
        workspace: opts.workspace.as_ref().map(|d| d.display().to_string()),
        worker_id: None,
        on_sandbox_lost: opts
            .on_sandbox_lost
            .or(req.on_sandbox_lost)
            .unwrap_or_default(),
        generation: 0,
        egress: req
            .network
            .as_ref()
            .map(|n| n.egress.clone())
            .unwrap_or_default(),
        tenant: opts.tenant.clone(),
    }
}

/// Every regular file under `dir`, as (path in the sandbox, contents).
pub(super) fn skill_files(dir: &Path) -> Result<Vec<(String, Vec<u8>)>, SessionError> {
    let invalid =
        |p: &Path, e: std::io::Error| SessionError::Invalid(format!("{}: {e}", p.display()));
    let mut out = Vec::new();
    let mut total = 0u64;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).map_err(|e| invalid(&d, e))? {
            let e = e.map_err(|e| invalid(&d, e))?;
            let path = e.path();
            let kind = e.file_type().map_err(|e| invalid(&path, e))?;
            if kind.is_dir() {
                stack.push(path);
            } else if kind.is_file() {
                let data = std::fs::read(&path).map_err(|e| invalid(&path, e))?;
                total += data.len() as u64;
                if total > MAX_SKILL_FILES_BYTES || out.len() >= MAX_SKILL_FILES {
                    return Err(SessionError::Invalid(format!(
                        "{}: the skills are over {} files or {} MiB",
                        dir.display(),
                        MAX_SKILL_FILES,
                        MAX_SKILL_FILES_BYTES >> 20
                    )));
                }
                let rel = path
                    .strip_prefix(dir)
                    .unwrap_or(&path)
                    .to_string_lossy()
                    .into_owned();
                out.push((format!("{SANDBOX_SKILLS_DIR}/{rel}"), data));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Copies files into the sandbox through the operation manager, and
/// waits for every one of them.
pub(super) async fn upload<M: OperationManager>(
    manager: &M,
    updates: &mut mpsc::Receiver<Operation>,
    files: Vec<(String, Vec<u8>)>,
) -> Result<(), SessionError> {
    let ops: Vec<(OperationId, String, Vec<u8>)> = files
        .into_iter()
        .map(|(path, data)| (OperationId::random(), path, data))
        .collect();
    let mut waiting: std::collections::HashMap<OperationId, String> = ops
        .iter()
        .map(|(id, path, _)| (id.clone(), path.clone()))
        .collect();
    // Operations are added while their updates are read: the manager's
    // update channel is bounded, and it must never wait on this caller.
    let adds = async {
        for (id, path, data) in ops {
            let spec = OperationSpec::WriteFile(WriteFileSpec::new(path.clone(), data));
            manager
                .add(Operation::new(id, spec))
                .await
                .map_err(|e| SessionError::Upload {
                    path,
                    error: e.to_string(),
                })?;
        }
        Ok::<_, SessionError>(())
    };
    let wait = async {
        while !waiting.is_empty() {
            let Some(op) = updates.recv().await else {
                return Err(SessionError::Upload {
                    path: waiting.values().next().cloned().unwrap_or_default(),
                    error: "the operation manager stopped".into(),
                });
            };
            if !op.status.is_terminal() {
                continue;
            }
            let Some(path) = waiting.remove(&op.id) else {
                continue;
            };
            let ok = op.status == OpStatus::Completed
                && op.result.as_ref().is_some_and(|r| r.outcome.is_success());
            if !ok {
                let error = match (&op.failure, &op.result) {
                    (Some(f), _) => f.clone(),
                    (None, Some(r)) => r.outcome.to_string(),
                    (None, None) => format!("{:?}", op.status),
                };
                return Err(SessionError::Upload { path, error });
            }
        }
        Ok(())
    };
    let both = async { tokio::try_join!(adds, wait).map(|_| ()) };
    match tokio::time::timeout(UPLOAD_PATIENCE, both).await {
        Ok(r) => r,
        Err(_) => Err(SessionError::Upload {
            path: waiting.values().next().cloned().unwrap_or_default(),
            error: format!("not done within {} s", UPLOAD_PATIENCE.as_secs()),
        }),
    }
}

/// Gives the core its inputs, wires the manager, model client and
/// coordinator, and starts the run.
pub(super) async fn launch<W: WorkerApi>(
    mut core: Core,
    worker: W,
    opts: RunOptions,
    files: Vec<(String, Vec<u8>)>,
    resumed: bool,
    models: &crate::llm::MakeModel,
) -> Result<SessionHandle, SessionError> {
    let config = core.config().clone();
    let endpoint = Endpoint::merge(config.endpoint.as_ref(), None, None);
    let mut llm_config = LlmConfig::new(endpoint.base_url, endpoint.api);
    llm_config.api_key = opts.api_key.clone();
    let llm = models(llm_config).map_err(|e| SessionError::Model(e.to_string()))?;
    let patience = opts
        .worker_lost_after
        .unwrap_or(crate::follow::DEFAULT_PATIENCE);
    // The run's trace, made from its records from here on: its runner's,
    // or (a caller that starts the session itself) one of its own, ended
    // with the run.
    let trace = opts.trace.clone().or_else(|| {
        opts.telemetry
            .as_ref()
            .map(|t| crate::telemetry::RunTrace::start(t, core.session_id()))
    });
    let contexts = trace.map(|run| {
        let contexts = run.with(|t| {
            t.set_model(&config.model);
            t.set_attribute("corral.sandbox.id", config.sandbox_id.to_string());
            if let Some(w) = &config.worker {
                t.set_attribute("corral.worker", w.clone());
            }
            t.contexts()
        });
        core.set_observer(Box::new(run));
        contexts
    });
    let (manager, mut updates) =
        Manager::start_traced(worker, config.sandbox_id.clone(), patience, contexts);
    let mut lost = manager.lost();
    let mut egress = manager.egress();
    if let Err(e) = upload(&manager, &mut updates, files).await {
        manager.shutdown().await;
        return Err(e);
    }
    if let Err(e) = give_inputs(&mut core, &opts) {
        manager.shutdown().await;
        return Err(e);
    }
    let (events_tx, events) = mpsc::channel(EVENTS_CAPACITY);
    let id = core.session_id().to_string();
    let _ = events_tx.try_send(Event::SessionStarted {
        session_id: id.clone(),
        resumed,
        sandbox_id: config.sandbox_id.to_string(),
        model: config.model.clone(),
        worker: config.worker.clone(),
    });
    let manager = Arc::new(manager);
    let (coordinator, inputs) = Coordinator::new(
        core,
        manager.clone(),
        updates,
        llm,
        events_tx,
        opts.settings,
    );
    // Not a sender: a caller that drops its inputs still ends the run.
    let inbox = inputs.downgrade();
    let task = tokio::spawn(async move {
        let run = coordinator.run();
        tokio::pin!(run);
        // A lost sandbox fails the run (the coordinator records why).
        let summary = loop {
            tokio::select! {
                summary = &mut run => break summary,
                changed = lost.changed() => {
                    let reason = lost.borrow_and_update().clone();
                    match (changed, reason, inbox.upgrade()) {
                        (Ok(()), Some(reason), Some(tx)) => {
                            tracing::warn!(%reason, "the session's sandbox is lost");
                            // The run goes on meanwhile (its inbox may be full).
                            tokio::select! {
                                summary = &mut run => break summary,
                                _ = tx.send(crate::agent::Inbox::SandboxLost(reason)) => {}
                            }
                        }
                        (Ok(()), _, _) => {}
                        _ => break run.await,
                    }
                }
                e = egress.recv() => match (e, inbox.upgrade()) {
                    (Ok(e), Some(tx)) => {
                        tokio::select! {
                            summary = &mut run => break summary,
                            _ = tx.send(crate::agent::Inbox::Egress(e)) => {}
                        }
                    }
                    (Err(tokio::sync::broadcast::error::RecvError::Lagged(n)), Some(tx)) => {
                        tracing::warn!(missed = n, "egress decisions were not recorded (too many at once)");
                        tokio::select! {
                            summary = &mut run => break summary,
                            _ = tx.send(crate::agent::Inbox::EgressUnrecorded(n)) => {}
                        }
                    }
                    // The manager is gone, or the run's inbox: the run
                    // ends on its own.
                    _ => break run.await,
                },
            }
        };
        // The coordinator is gone: its manager stops (operations keep
        // running on the worker).
        if let Ok(m) = Arc::try_unwrap(manager) {
            m.shutdown().await;
        }
        Ok(summary?)
    });
    Ok(SessionHandle {
        id,
        resumed,
        config,
        inputs,
        events,
        task,
    })
}

/// The run's inputs: the request's messages (the same request again asks
/// nothing twice), then its prompt (rerunning a run that did not finish,
/// with the same prompt, resumes it rather than asking again).
pub(super) fn give_inputs(core: &mut Core, opts: &RunOptions) -> Result<(), SessionError> {
    if opts.until_idle {
        core.stop(StopMode::WhenIdle, StopCause::Requested)?;
    }
    let resumed = core.state().turns() > 0 || core.state().last_input.is_some();
    for (i, m) in opts.request.messages.iter().enumerate() {
        match m.role {
            MessageRole::User => {
                let id = m.message_id.clone().unwrap_or_else(|| {
                    format!(
                        "message-{i}-{:016x}",
                        crate::llm::conform::fnv1a(m.content.as_bytes())
                    )
                });
                core.add_input(&id, &m.content)?;
            }
            MessageRole::Assistant if resumed => {
                tracing::warn!(
                    "assistant messages of a request apply to new sessions only; skipped"
                );
            }
            MessageRole::Assistant => core.history(Role::Assistant, &m.content)?,
        }
    }
    if let Some(prompt) = &opts.request.prompt {
        let repeat = core
            .state()
            .last_input
            .as_ref()
            .is_some_and(|(text, answered)| text == prompt && !answered);
        if !repeat {
            core.add_input(&uuid::Uuid::new_v4().to_string(), prompt)?;
        }
    }
    core.kick()?;
    Ok(())
}
