package provider

import (
	"context"
	"fmt"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// finishDelete stops the VM (if any) within the grace period, removes the
// state dir, pushes the terminal status and forgets the pod.
func (r *podRun) finishDelete() {
	p, rec := r.node, r.rec
	vm := rec.vm.get()
	grace := rec.deletion().grace
	pod, st := rec.read()
	rejected := st.Rejection != nil
	log := p.log.WithValues("pod", klog.KObj(pod), "uid", rec.uid)
	ctx := context.WithoutCancel(p.base)
	// The exporter unregisters first: no lease lands on a VM going away.
	rec.stopExporter()
	r.dropSnapshotClaim()

	if !rejected {
		if vm != nil {
			opts, msg := deleteStop(grace, exporter.BootsEmptyDisk(st))
			p.event(pod, corev1.EventTypeNormal, "Killing", msg)
			ex, err := vm.Stop(ctx, opts)
			if err != nil {
				log.Error(err, "Stop VM")
			}
			log.Info("VM stopped", "exitCode", ex.ExitCode, "reason", ex.Reason)
			p.cfg.Telemetry.VMExited(rec.uid, ex)
			rec.change(func(st *podstatus.VMState) {
				st.SetTerminated(podstatus.TerminatedFromExit(ex, runStart(st), podstatus.ContainerIDPrefix+string(rec.uid)))
			})
			rec.vm.set(nil)
		} else {
			rec.change(func(st *podstatus.VMState) {
				if st.Terminated == nil {
					now := p.now()
					st.SetTerminated(corev1.ContainerStateTerminated{ExitCode: 137, Reason: "ContainerStatusUnknown",
						Message: "the pod was deleted before its VM started", StartedAt: podstatus.MetaTime(now), FinishedAt: podstatus.MetaTime(now)})
				}
			})
		}
		if r.reclaimDisk(ctx, pod) { // state.go: the disk kept first, if asked
			if err := qemu.CleanStateDir(rec.dir, nil); err != nil {
				log.Error(err, "Remove pod state dir")
			}
		}
		r.releaseImage()
	}
	rec.markRemoved()
	p.push(rec)
	p.pump.Flush(rec.uid) // the terminal status reaches the library before the pod goes
	r.pods.forget(r)
	rec.waitExporter(10 * time.Second)
	log.Info("Pod deleted from node")
	if p.cfg.ForceDelete != nil && pod.DeletionTimestamp != nil {
		if err := p.cfg.ForceDelete(ctx, p.withStatus(rec)); err != nil {
			log.V(1).Info("Final delete of pod", "err", err)
		}
	}
}

// deleteStop is how a delete stops the VM, and the Killing event's
// message: through the ACPI power button within the grace period, or at
// once when the VM boots its empty disk (no guest answers the button: it
// would only wait the grace out). Everything in the state dir is kept
// until the disk's reclaim policy is applied. Pure.
func deleteStop(grace time.Duration, emptyDisk bool) (qemu.StopOptions, string) {
	if emptyDisk {
		return qemu.StopOptions{NoACPI: true, QuitGrace: podstatus.QuitGrace, Keep: []string{"*"}},
			"Stopping VM at once (it boots an empty disk: no guest answers the ACPI power button)"
	}
	acpi := podstatus.ACPIBudget(grace)
	return qemu.StopOptions{Grace: acpi, QuitGrace: podstatus.QuitGrace, Keep: []string{"*"}},
		fmt.Sprintf("Stopping VM (ACPI power button, %s before quit)", acpi.Round(time.Second))
}
