package provider

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
)

// RecoveryResult counts what Recover found.
type RecoveryResult struct {
	// Running VMs re-adopted (same QEMU process).
	Running int
	// Exited VMs whose exit was recorded while nobody watched.
	Exited int
	// Pending pods whose VM was not started yet (crash mid-create).
	Pending int
	// PoweredOff pods whose VM was powered off on request (Jumpstarter
	// power off): they stay off until powered on.
	PoweredOff int
	// Orphans: state dirs without an intent record; their QEMU (if any)
	// was killed and the dir removed.
	Orphans int
}

// Recover re-adopts every pod found under <stateDir>/vms, before the pod
// controller starts: running VMs keep running (Hypervisor.Adopt) and report
// Running; VMs that ended while qemu-kubelet was down report how they ended
// and get their restart policy applied; pods whose creation was interrupted
// resume it. Nothing new is started for a recovered pod until the library
// shows the pod still exists (GetPod/UpdatePod) — a pod deleted while
// qemu-kubelet was down is instead deleted by the library's start-up sweep
// (GetPods lists it, DeletePod stops and cleans it). Workers start at once.
func (p *VMs) Recover(ctx context.Context) (RecoveryResult, error) {
	var res RecoveryResult
	log := klog.FromContext(ctx)
	ents, err := os.ReadDir(p.vmsDir())
	if errors.Is(err, os.ErrNotExist) {
		return res, nil
	}
	if err != nil {
		return res, fmt.Errorf("recover VMs: %w", err)
	}
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		dir := filepath.Join(p.vmsDir(), e.Name())
		run, kind, err := p.recoverOne(ctx, dir)
		if err != nil {
			log.Error(err, "Recover pod state dir", "dir", dir)
			continue
		}
		switch kind {
		case "orphan":
			res.Orphans++
			continue
		case "running":
			res.Running++
		case "exited":
			res.Exited++
		case "poweredOff":
			res.PoweredOff++
		default:
			res.Pending++
		}
		p.mu.Lock()
		p.pods[run.rec.uid] = run
		p.mu.Unlock()
		log.Info("Recovered pod", "pod", klog.KObj(run.rec.pod), "uid", run.rec.uid, "vm", kind)
		go run.run()
	}
	return res, nil
}

func (p *VMs) recoverOne(ctx context.Context, dir string) (*podRun, string, error) {
	log := klog.FromContext(ctx).WithValues("dir", dir)
	var pod corev1.Pod
	b, err := os.ReadFile(filepath.Join(dir, PodFileName))
	if err == nil {
		err = json.Unmarshal(b, &pod)
	}
	if err != nil || pod.UID == "" || string(pod.UID) != filepath.Base(dir) {
		// No usable intent record: nothing may run here.
		log.Info("Removing orphaned VM state dir", "why", fmt.Sprint(err))
		if _, serr := os.Stat(filepath.Join(dir, qemu.SpecFileName)); serr == nil {
			if vm, aerr := p.cfg.Hypervisor.Adopt(ctx, dir); aerr == nil {
				if _, exited := vm.Exit(); !exited {
					vm.Kill()
					<-vm.Done()
				}
			} else {
				log.Error(aerr, "Adopt orphaned VM")
			}
		}
		if err := qemu.CleanStateDir(dir, nil); err != nil {
			return nil, "", err
		}
		return nil, "orphan", nil
	}

	run := p.newRun(&pod) // dir is its podDir: named by its UID
	rec := run.rec
	if b, err := os.ReadFile(filepath.Join(dir, StatusFileName)); err == nil {
		if err := json.Unmarshal(b, &rec.state); err != nil {
			log.Error(err, "Unreadable status record; starting from scratch")
			rec.state = podstatus.VMState{}
		}
	}
	if rec.state.StartTime.IsZero() {
		rec.state.StartTime = p.now().UTC()
	}
	plan, rej := podspec.Translate(&pod, p.arch())
	if rej != nil {
		rec.state.Rejection, rec.state.Final = rej, true
	}
	rec.plan = plan
	if rec.state.ImageDigest != "" && p.cfg.Images != nil {
		if rel, err := p.cfg.Images.Acquire(rec.state.ImageDigest); err == nil {
			rec.release = rel
		}
	}

	if _, err := os.Stat(filepath.Join(dir, qemu.SpecFileName)); err != nil {
		if !rec.state.Final {
			rec.state.SetWaiting(podstatus.ReasonContainerCreating, "")
		}
		return run, "pending", nil
	}
	vm, err := p.cfg.Hypervisor.Adopt(ctx, dir)
	if err != nil {
		// QEMU is alive but unreachable: do not leave it running unmanaged
		// (and a restart could not start a new one next to it).
		if kerr := qemu.KillStale(dir, 10*time.Second); kerr != nil {
			log.Error(kerr, "Kill unreachable QEMU")
		}
		now := p.now()
		rec.state.SetTerminated(corev1.ContainerStateTerminated{ExitCode: 128, Reason: podstatus.ReasonStartError,
			Message: "could not re-adopt the VM after a restart: " + err.Error(), StartedAt: podstatus.MetaTime(now), FinishedAt: podstatus.MetaTime(now)})
		rec.handoff.pendingExit = true
		return run, "exited", nil
	}
	if ex, exited := vm.Exit(); exited {
		if rec.state.Final {
			return run, "exited", nil
		}
		if rec.state.PoweredOff {
			// Powered off on request (the exporter): it stays off.
			return run, "poweredOff", nil
		}
		started := time.Now()
		if rec.state.Running != nil {
			started = rec.state.Running.StartedAt.Time
		}
		if rec.state.Running != nil || rec.state.Terminated == nil {
			rec.state.SetTerminated(podstatus.TerminatedFromExit(ex, started, podstatus.ContainerIDPrefix+string(pod.UID)))
		}
		rec.handoff.pendingExit = true
		return run, "exited", nil
	}
	rec.vm.set(vm)
	rec.state.PoweredOff = false
	if rec.state.Running == nil {
		rec.state.SetRunning(p.now())
	}
	return run, "running", nil
}

// podUIDs lists the pods known, for tests and logs.
func (p *VMs) podUIDs() []types.UID {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]types.UID, 0, len(p.pods))
	for u := range p.pods {
		out = append(out, u)
	}
	return out
}
