package provider

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// The pod worker's side of the pod's Jumpstarter exporter (package
// exporter): the worker starts it (its first Ready, or found powered off:
// podworker.go), stops it (finished, deleted) and serves its power and
// flash requests (power.go); podExporter is the pod as the exporter sees
// it. The exporter's settings, supervisor, condition and the VM as its
// target are package exporter's.

// startExporter starts the pod's exporter supervisor if the pod asks for
// one and it has not started yet. Idempotent; worker only.
func (r *podRun) startExporter(ctx context.Context) {
	p, rec := r.node, r.rec
	pod, st := rec.read()
	if podspec.ExporterSecretName(pod) == "" || st.Rejection != nil || st.Final || rec.deletion().deleting || rec.exp.Load() != nil {
		return
	}
	sup := exporter.New(p.exporterNode(), podExporter{run: r})
	rec.exp.Store(sup)
	sup.Start(ctx)
}

// exporterNode is what the exporters of the node's pods share.
func (p *nodeWide) exporterNode() *exporter.Node {
	return &exporter.Node{Runner: p.cfg.Exporters, Secrets: p.cfg.Secrets, Images: p.cfg.Images, UEFICode: p.cfg.UEFICode,
		UEFIVars: p.cfg.UEFIVars, Backoff: p.cfg.Backoff, Observer: p.cfg.Telemetry.ExporterObserver(), Now: p.now}
}

// exporter is the pod's exporter supervisor (nil: not started).
func (rec *podVM) exporter() *exporter.Supervisor { return rec.exp.Load() }

// stopExporter ends the exporter supervisor (it unregisters); idempotent.
func (rec *podVM) stopExporter() {
	if sup := rec.exporter(); sup != nil {
		sup.Stop()
	}
}

// waitExporter waits up to d for the exporter supervisor to end.
func (rec *podVM) waitExporter(d time.Duration) {
	if sup := rec.exporter(); sup != nil {
		sup.Wait(d)
	}
}

// nodeCapacity is what admission checks pods against.
func (p *nodeWide) nodeCapacity() podspec.NodeCapacity {
	return podspec.NodeCapacity{Allocatable: p.allocatable(), Accelerator: p.cfg.Accelerator, UEFI: p.cfg.UEFICode != "",
		VMOverhead: *resource.NewQuantity(p.cfg.VMOverhead, resource.BinarySI)}
}

// podExporter is one pod as its exporter sees it (exporter.Pod): its run's
// record read through podVM's methods, its requests sent to its worker.
type podExporter struct{ run *podRun }

var (
	_ exporter.Pod            = podExporter{}
	_ exporter.PodPowerOffNow = podExporter{}
)

func (e podExporter) Pod() *corev1.Pod { return e.run.rec.podCopy() }

func (e podExporter) Record() (podspec.Plan, podstatus.VMState) {
	return e.run.rec.plan, e.run.rec.stateCopy()
}

func (e podExporter) Dir() string     { return e.run.rec.dir }
func (e podExporter) Overlay() string { return filepath.Join(e.run.rec.dir, OverlayFileName) }

func (e podExporter) VM() exporter.VM {
	if vm := e.run.rec.vm.get(); vm != nil {
		return vm
	}
	return nil // no VM, not a nil VM in an interface
}

func (e podExporter) Event(typ, reason, msg string) { e.run.node.event(e.Pod(), typ, reason, msg) }
func (e podExporter) Changed()                      { e.run.node.push(e.run.rec) }

func (e podExporter) PowerOn(ctx context.Context) error {
	return e.run.request(ctx, vmRequest{op: opPowerOn})
}

func (e podExporter) PowerOff(ctx context.Context) error {
	return e.run.request(ctx, vmRequest{op: opPowerOff})
}

// PowerOffNow is the exporter's power off: at once, QEMU told to quit and
// killed after 5 s (exporter.PodPowerOffNow); PowerOff is its shutdown.
func (e podExporter) PowerOffNow(ctx context.Context) error {
	return e.run.request(ctx, vmRequest{op: opPowerOff, now: true})
}

func (e podExporter) Flash(ctx context.Context, f *exporter.Flash) error {
	op := opFlash
	if f.IsReset() {
		op = opReset
	}
	return e.run.request(ctx, vmRequest{op: op, flash: f})
}

// SetSize is a resize request to the pod's worker (opResize), which
// checks and records the size (recordSize).
func (e podExporter) SetSize(ctx context.Context, check func(*corev1.Pod, podspec.NodeCapacity, []*corev1.Pod) error, change func(*podstatus.VMSize)) error {
	return e.run.request(ctx, vmRequest{op: opResize, resize: &sizeChange{check: check, change: change}})
}

// recordSize serves a resize request (actResize): it checks and changes
// the pod's size under the admission lock (podSet.admitting, so no pod is
// admitted against the old claim meanwhile) and writes it to status.json; a size
// that cannot be written is not kept. The VM's next starts apply it
// (runPlan). Worker only.
func (r *podRun) recordSize(sz *sizeChange) error {
	p, rec := r.node, r.rec
	node := p.nodeCapacity()
	var old *podstatus.VMSize
	err := r.pods.admitting(func(others []*corev1.Pod) error {
		if err := sz.check(rec.podCopy(), node, others); err != nil {
			return err
		}
		rec.change(func(st *podstatus.VMState) {
			if st.Size != nil {
				c := *st.Size
				old = &c
			} else {
				st.Size = &podstatus.VMSize{}
			}
			sz.change(st.Size)
			st.Size.Changed = p.now().UTC()
		})
		return nil
	})
	if err != nil {
		return err
	}
	if err := rec.persist(); err != nil {
		rec.change(func(st *podstatus.VMState) { st.Size = old })
		r.persist() // the record as it was (and the event of a failing disk)
		return fmt.Errorf("record the size in the pod's state dir: %w", err)
	}
	return nil
}

// installFlash makes the flash the one the VM boots from now on
// (exporter.Flash: Place, Record, then Commit): the next start makes a
// fresh overlay over it. It is written to the state dir (status.json)
// before it is answered, so a VM restart and an agent restart keep it. A
// flash that fails half way (Place, or the status write) leaves the
// pod's record and disk as they were, and status.json as it was written
// last. The request's image hold becomes the pod's. Worker only, with no
// VM running.
func (r *podRun) installFlash(f *exporter.Flash) error {
	p, rec := r.node, r.rec
	placed, err := f.Place(rec.dir, filepath.Join(rec.dir, OverlayFileName))
	if err != nil {
		return err
	}
	var before podstatus.VMState
	var podImageGoes bool
	var stale string
	rec.change(func(st *podstatus.VMState) {
		before = *st
		podImageGoes, stale = f.Record(rec.dir, st)
	})
	// Through the pod's status writer (persist.go): serialized with the
	// other owners' writes, and the newest state is the last written.
	if err := rec.persistKeep(); err != nil {
		rec.change(func(st *podstatus.VMState) { f.Unrecord(st, before) })
		if uerr := placed.Undo(); uerr != nil {
			p.log.Error(uerr, "Flash: put the disk back as it was")
		}
		return f.RecordError(err)
	}
	placed.Commit()
	var old func()
	switch {
	case f.Image != nil: // the image's hold becomes the pod's
		old, rec.release, f.Hold = rec.release, f.Hold, nil
	case podImageGoes:
		old, rec.release = rec.release, nil
	}
	pod := rec.podCopy()
	if old != nil {
		old()
	}
	if stale != "" {
		if err := os.Remove(stale); err != nil && !errors.Is(err, os.ErrNotExist) {
			p.log.Error(err, "Flash: remove the file it replaced")
		}
	}
	p.push(rec)
	p.event(pod, corev1.EventTypeNormal, f.Reason(), f.Flashed())
	return nil
}
