// The browser page: microphone -> /v1/stream, file -> /v1/transcriptions (async job).
const $ = (id) => document.getElementById(id);
const POLL_MS = 500;
const SAMPLE_RATE = 16000;
const MAX_PENDING = 50; // 100 ms frames held while the session opens

const apiKey = () => $("api-key").value.trim();
const language = () => $("language").value.trim() || "en";

function showError(message) {
  $("error").textContent = message || "";
}

function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error) return `${response.status} ${body.error.code}: ${body.error.message}`;
  } catch (_) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

const seconds = (ms) => (ms / 1000).toFixed(1);

// --- live: microphone over /v1/stream --------------------------------------------

class LiveStream {
  constructor() {
    this.ws = null;
    this.audio = null;
    this.media = null;
    this.ended = false; // `end` was sent: no more audio
  }

  get active() { return this.ws !== null; }

  url() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const query = new URLSearchParams({ sample_rate: String(SAMPLE_RATE), language: language() });
    if (apiKey()) query.set("api_key", apiKey());
    return `${scheme}://${location.host}/v1/stream?${query}`;
  }

  async start() {
    showError("");
    this.media = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false,
               autoGainControl: false },
    });
    this.audio = new AudioContext();
    await this.audio.audioWorklet.addModule("/static/pcm-worklet.js");
    const source = this.audio.createMediaStreamSource(this.media);
    const worklet = new AudioWorkletNode(this.audio, "pcm-worklet",
                                         { processorOptions: { frameMs: 100 } });
    const mute = this.audio.createGain();
    mute.gain.value = 0; // the graph must reach the destination to be pulled
    source.connect(worklet).connect(mute).connect(this.audio.destination);

    this.ws = new WebSocket(this.url());
    this.ws.binaryType = "arraybuffer";
    this.ws.onmessage = (msg) => this.onEvent(JSON.parse(msg.data));
    this.ws.onclose = (ev) => this.onClose(ev);
    // speech from before `ready` is kept (up to MAX_PENDING frames) and sent then
    this.pending = [];
    this.ended = false;
    worklet.port.onmessage = (msg) => this.sendFrame(msg.data);
    setMic(true, "Connecting…");
  }

  sendFrame(frame) {
    // frames the worklet posted before stop() may still arrive: audio after `end`
    // is a protocol error (close 1008), so they are dropped
    if (!this.ws || this.ended) return;
    if (this.pending !== null) {
      if (this.pending.length < MAX_PENDING) this.pending.push(frame);
    } else if (this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(frame);
    }
  }

  onEvent(event) {
    switch (event.type) {
      case "ready":
        for (const frame of this.pending || []) this.ws.send(frame);
        this.pending = null;
        setMic(true, `Listening (session ${event.session_id}, ${event.lane} lane).`);
        break;
      case "partial":
        $("partial").textContent = event.text;
        break;
      case "final":
        addFinal(event);
        $("partial").textContent = "";
        break;
      case "error":
        showError(`Stream error ${event.code}: ${event.message}`);
        break;
      case "done":
        setMic(false, "Done.");
        break;
      default:
        break;
    }
  }

  onClose(ev) {
    this.release();
    this.ws = null;
    if (ev.code !== 1000 && ev.code !== 1005) setMic(false, `Closed (${ev.code}).`);
    else setMic(false, "Done.");
  }

  release() {
    if (this.media) this.media.getTracks().forEach((t) => t.stop());
    if (this.audio) this.audio.close();
    this.media = null;
    this.audio = null;
  }

  stop() {
    // the server sends the last finals, then done, then closes
    this.release();
    this.ended = true;
    if (this.ws && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(JSON.stringify({ type: "end" }));
      setMic(false, "Finishing…");
    } else if (this.ws) {
      this.ws.close();
    }
  }
}

function setMic(on, status) {
  const button = $("mic");
  button.setAttribute("aria-pressed", String(on));
  button.textContent = on ? "Stop microphone" : "Start microphone";
  $("mic-status").textContent = status;
}

function addFinal(event) {
  if (!event.text) return;
  const item = document.createElement("li");
  const time = document.createElement("span");
  time.className = "time";
  time.textContent = `${seconds(event.start_ms)}–${seconds(event.end_ms)} s `;
  item.append(time, event.text);
  $("finals").append(item);
}

// --- uploads: /v1/transcriptions as an async job ---------------------------------

async function upload(file) {
  showError("");
  $("result").hidden = true;
  const form = new FormData();
  form.append("file", file);
  form.append("language", language());
  form.append("async", "true");
  const response = await fetch("/v1/transcriptions", { method: "POST", body: form,
                                                       headers: authHeaders() });
  if (response.status !== 202) throw new Error(await errorText(response));
  const job = await response.json();
  $("job").hidden = false;
  $("job-id").textContent = job.id;
  await follow(job.id);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function follow(id) {
  for (;;) {
    const response = await fetch(`/v1/transcriptions/${id}`, { headers: authHeaders() });
    if (!response.ok) throw new Error(await errorText(response));
    const job = await response.json();
    $("job-status").textContent = job.status;
    $("progress").value = job.progress;
    if (job.status === "completed") return showResult(id);
    if (job.status === "failed") throw new Error(`job failed: ${job.error || "unknown"}`);
    if (job.status === "cancelled") throw new Error("job was cancelled");
    await sleep(POLL_MS);
  }
}

async function showResult(id) {
  const response = await fetch(`/v1/transcriptions/${id}?format=json`,
                               { headers: authHeaders() });
  if (!response.ok) throw new Error(await errorText(response));
  const transcript = await response.json();
  $("result-text").textContent = transcript.text || "(no speech recognised)";
  const rows = $("words");
  rows.replaceChildren();
  for (const segment of transcript.segments) {
    for (const word of segment.words) {
      const row = document.createElement("tr");
      for (const cell of [word.word, word.start.toFixed(2), word.end.toFixed(2)]) {
        const td = document.createElement("td");
        td.textContent = cell;
        row.append(td);
      }
      rows.append(row);
    }
  }
  $("result").dataset.jobId = id;
  $("result").hidden = false;
}

async function download(format) {
  const id = $("result").dataset.jobId;
  const response = await fetch(`/v1/transcriptions/${id}?format=${format}`,
                               { headers: authHeaders() });
  if (!response.ok) throw new Error(await errorText(response));
  const url = URL.createObjectURL(await response.blob());
  const link = document.createElement("a");
  link.href = url;
  link.download = `${id}.${format}`;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

// --- wiring ------------------------------------------------------------------------

const live = new LiveStream();
const reportErrors = (promise) => promise.catch((err) => showError(err.message || String(err)));

$("mic").addEventListener("click", () => {
  if (live.active) live.stop();
  else reportErrors(live.start().catch((err) => { live.release(); setMic(false, "Idle."); throw err; }));
});

$("upload-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const file = $("file").files[0];
  if (!file) return;
  const button = $("upload");
  button.disabled = true;
  reportErrors(upload(file)).finally(() => { button.disabled = false; });
});

for (const button of document.querySelectorAll(".downloads button")) {
  button.addEventListener("click", () => reportErrors(download(button.dataset.format)));
}
