// The page's client of WS /v1/audio/speech/stream: text deltas in, 24 kHz s16le PCM frames out, played
// back to back with Web Audio as they arrive.
"use strict";
const $ = (id) => document.getElementById(id);
const SAMPLE_RATE = 24000;
let ws = null, audioCtx = null, playAt = 0, startedAt = 0, firstAudio = null, frames = 0, samples = 0;

function log(line) {
  const el = $("log");
  el.textContent += line + "\n";
  el.scrollTop = el.scrollHeight;
}

async function init() {
  const ready = await fetch("/ready").then((r) => r.json()).catch(() => ({}));
  if (ready.demo) $("demo").textContent = "Demo bundle: random weights, the audio is noise.";
  const voices = await fetch("/v1/audio/voices");
  if (voices.status === 401) { $("keybox").hidden = false; return; }
  if (voices.ok) {
    for (const v of (await voices.json()).data) {
      const o = document.createElement("option");
      o.value = v.id; o.textContent = v.name;
      $("voice").appendChild(o);
    }
  }
}

function splitLikeAnLlm(text) {
  // deltas of 1-3 words, as a language model streams them
  const words = text.match(/\S+\s*/g) || [];
  const out = [];
  for (let i = 0; i < words.length;) {
    const n = 1 + Math.floor(Math.random() * 3);
    out.push(words.slice(i, i + n).join(""));
    i += n;
  }
  return out;
}

function play(buffer) {
  const pcm = new Int16Array(buffer);
  const audio = audioCtx.createBuffer(1, pcm.length, SAMPLE_RATE);
  const ch = audio.getChannelData(0);
  for (let i = 0; i < pcm.length; i++) ch[i] = pcm[i] / 32768;
  const src = audioCtx.createBufferSource();
  src.buffer = audio;
  src.connect(audioCtx.destination);
  playAt = Math.max(playAt, audioCtx.currentTime + 0.05);
  src.start(playAt);
  playAt += audio.duration;
  samples += pcm.length;
  frames += 1;
  $("seconds").textContent = (samples / SAMPLE_RATE).toFixed(2) + " s";
  $("frames").textContent = frames;
}

async function speak() {
  if (ws) ws.close();
  audioCtx = audioCtx || new AudioContext({ sampleRate: SAMPLE_RATE });
  await audioCtx.resume();
  playAt = 0; frames = 0; samples = 0; firstAudio = null;
  for (const id of ["ttfa", "seconds", "frames", "rtf"]) $(id).textContent = "–";
  const key = $("key").value;
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  const url = `${proto}//${location.host}/v1/audio/speech/stream` + (key ? `?api_key=${encodeURIComponent(key)}` : "");
  ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  $("status").textContent = "connecting";
  $("stop").disabled = false;
  ws.onmessage = (ev) => {
    if (typeof ev.data !== "string") {
      if (firstAudio === null) {
        firstAudio = performance.now();
        $("ttfa").textContent = Math.round(firstAudio - startedAt) + " ms";
        $("status").textContent = "speaking";
      }
      play(ev.data);
      return;
    }
    const msg = JSON.parse(ev.data);
    log(JSON.stringify(msg));
    if (msg.type === "session.created") send();
    if (msg.type === "response.done") {
      $("status").textContent = "done (" + msg.finish_reason + ")";
      if (msg.timing && msg.timing.realtime_factor != null) $("rtf").textContent = msg.timing.realtime_factor;
      $("stop").disabled = true;
      ws.close();
    }
    if (msg.type === "error") $("status").textContent = "error: " + msg.error.message;
  };
  ws.onclose = () => { $("stop").disabled = true; };
}

async function send() {
  ws.send(JSON.stringify({ type: "session.update", voice: $("voice").value, response_format: "pcm" }));
  const text = $("text").value;
  const deltas = $("typing").checked ? splitLikeAnLlm(text) : [text];
  startedAt = performance.now();
  $("status").textContent = "streaming text";
  for (const d of deltas) {
    if (!ws || ws.readyState !== WebSocket.OPEN) return;
    ws.send(JSON.stringify({ type: "input.text", text: d }));
    if (deltas.length > 1) await new Promise((r) => setTimeout(r, 40 + Math.random() * 60));
  }
  ws.send(JSON.stringify({ type: "input.done" }));
}

$("speak").onclick = speak;
$("stop").onclick = () => { if (ws) ws.send(JSON.stringify({ type: "response.cancel" })); };
init();
