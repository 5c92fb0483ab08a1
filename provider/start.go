package provider

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// pullAndStart pulls the image (retrying with back-off, showing
// ErrImagePull / ImagePullBackOff) and starts the VM. ok is false when
// interrupted (delete, shutdown) or when the start failed (recorded as a
// terminated run).
func (p *VMs) pullAndStart(ctx context.Context, rec *podVM) (VM, bool) {
	log := klog.FromContext(ctx)
	p.dropSnapshotClaim(rec) // an earlier run's, unused
	rec.mu.Lock()
	rec.snap.used, rec.snap.restoreFailed = nil, false
	pod := rec.pod.DeepCopy()
	plan := rec.plan
	if rec.state.FlashedImage != "" {
		// Flashed (exporter.go): boot that image, pinned by digest.
		plan.Image, plan.PullPolicy = rec.state.FlashedImage, oci.PullIfNotPresent
	}
	var size podstatus.VMSize // set through the exporter (vmsize.go)
	if rec.state.Size != nil {
		size = *rec.state.Size
		if size.MemoryBytes > 0 {
			plan.MemoryMiB = podspec.MemoryMiB(size.MemoryBytes)
		}
		plan.DiskBytes = size.DiskBytes
	}
	rec.mu.Unlock()

	// Cancel the pull when the pod is deleted.
	pctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-rec.deleteReq:
			cancel()
		case <-pctx.Done():
		}
	}()
	att := p.cfg.Telemetry.BeginStart(pctx, rec.uid, pod, plan.Image) // tracing.go: pod.start span, start metrics
	defer att.Done()

	// A flashed root (exporter_flash.go) boots instead of any image.
	img := p.flashedRoot(rec)
	for attempt := 1; img == nil; attempt++ {
		t0 := time.Now()
		if img = p.presentImage(pctx, plan); img != nil {
			// As the kubelet: one Pulled event, no Pulling, for a cached image.
			att.Pulled(t0, nil)
			p.event(pod, corev1.EventTypeNormal, "Pulled", fmt.Sprintf("Container image %q already present on machine", plan.Image))
			break
		}
		auth := p.pullSecrets(pctx, pod, plan.PullSecrets)
		p.event(pod, corev1.EventTypeNormal, "Pulling", fmt.Sprintf("Pulling image %q", plan.Image))
		var err error
		img, err = p.cfg.Images.Pull(pctx, plan.Image, oci.PullOptions{Auth: auth, Policy: plan.PullPolicy})
		att.Pulled(t0, err)
		if err == nil {
			p.event(pod, corev1.EventTypeNormal, "Pulled", fmt.Sprintf("Successfully pulled image %q (%s) in %s", plan.Image, img.Digest, time.Since(t0).Round(time.Millisecond)))
			break
		}
		if pctx.Err() != nil {
			return nil, false
		}
		msg := err.Error()
		log.Info("Image pull failed", "image", plan.Image, "attempt", attempt, "err", msg)
		p.event(pod, corev1.EventTypeWarning, "Failed", fmt.Sprintf("Failed to pull image %q: %s", plan.Image, msg))
		p.update(rec, func(st *podstatus.VMState) { st.SetWaiting(podstatus.ReasonErrImagePull, msg) })
		delay := p.cfg.Backoff.Delay(attempt)
		hold := min(p.cfg.ErrImagePullHold, delay)
		if !sleepCtx(pctx, hold) {
			return nil, false
		}
		p.update(rec, func(st *podstatus.VMState) {
			st.SetWaiting(podstatus.ReasonImagePullBackOff, podstatus.PullBackOffMessage(plan.Image, msg))
		})
		p.event(pod, corev1.EventTypeNormal, "BackOff", fmt.Sprintf("Back-off pulling image %q", plan.Image))
		if !sleepCtx(pctx, delay-hold) {
			return nil, false
		}
	}

	// Hold the image while the pod lives.
	rec.mu.Lock()
	haveRelease := rec.release != nil && rec.state.ImageDigest == img.Digest
	rec.mu.Unlock()
	if !haveRelease {
		p.releaseImage(rec)
	}
	if !haveRelease && !isFlashedRoot(img) {
		if rel, err := p.cfg.Images.Acquire(img.Digest); err == nil {
			rec.mu.Lock()
			rec.release = rel
			rec.mu.Unlock()
		} else {
			log.Error(err, "Acquire image")
		}
	}
	p.update(rec, func(st *podstatus.VMState) {
		st.ImageDigest = img.Digest
		st.ImageID = imageID(img)
		st.SetWaiting(podstatus.ReasonContainerCreating, "")
	})

	spec, err := p.vmSpec(ctx, rec, pod, plan, img)
	for attempt := 1; err != nil && podspec.IsConfigError(err); attempt++ {
		// A missing Secret/ConfigMap: wait for it, as a kubelet (podspec.PrepareGuestDisks).
		msg := err.Error()
		log.Info("VM config not available", "err", msg)
		p.event(pod, corev1.EventTypeWarning, "Failed", "Error: "+msg)
		p.update(rec, func(st *podstatus.VMState) { st.SetWaiting(podspec.ReasonCreateContainerConfigError, msg) })
		if !sleepCtx(pctx, min(p.cfg.Backoff.Delay(attempt), podspec.ConfigRetryMax)) {
			return nil, false
		}
		rec.mu.Lock()
		pod = rec.pod.DeepCopy()
		rec.mu.Unlock()
		spec, err = p.vmSpec(ctx, rec, pod, plan, img)
	}
	att.Overlaid(err)
	if err != nil {
		reason := podstatus.ReasonStartError
		if _, ok := errors.AsType[podspec.InvalidSpec](err); ok {
			reason = podstatus.ReasonInvalidVMSpec
		}
		log.Error(err, "VM not started", "reason", reason)
		p.event(pod, corev1.EventTypeWarning, "Failed", err.Error())
		now := p.now()
		p.update(rec, func(st *podstatus.VMState) {
			st.SetTerminated(corev1.ContainerStateTerminated{ExitCode: 128, Reason: reason, Message: err.Error(),
				StartedAt: podstatus.MetaTime(now), FinishedAt: podstatus.MetaTime(now)})
		})
		return nil, false
	}
	sctx, scancel := context.WithTimeout(pctx, p.cfg.StartTimeout)
	vm, err := p.cfg.Hypervisor.Start(sctx, spec, rec.dir)
	scancel()
	if err != nil && spec.Incoming != "" && pctx.Err() == nil {
		// The snapshot cannot be loaded: discard it and boot (snapshots.go).
		spec, err = p.restoreFailed(ctx, rec, pod, plan, img, err)
		if err == nil {
			sctx, scancel := context.WithTimeout(pctx, p.cfg.StartTimeout)
			vm, err = p.cfg.Hypervisor.Start(sctx, spec, rec.dir)
			scancel()
		}
	}
	att.QEMUStarted(vm, err)
	if err != nil {
		if pctx.Err() != nil {
			return nil, false
		}
		log.Error(err, "QEMU start failed")
		p.event(pod, corev1.EventTypeWarning, "Failed", "Error: "+err.Error())
		now := p.now()
		p.update(rec, func(st *podstatus.VMState) {
			st.SetTerminated(corev1.ContainerStateTerminated{ExitCode: 128, Reason: podstatus.ReasonStartError, Message: err.Error(),
				StartedAt: podstatus.MetaTime(now), FinishedAt: podstatus.MetaTime(now)})
		})
		return nil, false
	}
	rec.mu.Lock()
	rec.vm = vm
	rec.mu.Unlock()
	from := ""
	if spec.Incoming != "" {
		from = ", restored from a memory snapshot"
	}
	log.Info("VM started", "pid", vm.Pid(), "accelerator", spec.Accelerator, "fromSnapshot", spec.Incoming != "")
	p.event(pod, corev1.EventTypeNormal, "Started", fmt.Sprintf("Started VM (QEMU pid %d, %s, %d vCPU, %d MiB%s)", vm.Pid(), spec.Accelerator, spec.CPUs, spec.MemoryMiB, from))
	p.update(rec, func(st *podstatus.VMState) {
		st.SetRunning(p.now())
		if st.Size != nil && (st.Size.AppliedMemoryBytes != size.MemoryBytes || st.Size.AppliedDiskBytes != size.DiskBytes) {
			st.Size.AppliedMemoryBytes, st.Size.AppliedDiskBytes = size.MemoryBytes, size.DiskBytes
			st.Size.Changed = p.now().UTC()
		}
	})
	return vm, true
}

// presentImage returns the cached image of plan when its pull policy lets
// the node use it without asking the registry (IfNotPresent, Never), else
// nil. It never contacts a registry.
func (p *VMs) presentImage(ctx context.Context, plan podspec.Plan) *oci.Image {
	if plan.PullPolicy == oci.PullAlways {
		return nil
	}
	img, err := p.cfg.Images.Pull(ctx, plan.Image, oci.PullOptions{Policy: oci.PullNever})
	if err != nil {
		return nil
	}
	return img
}

// vmSpec builds the VM spec for a pulled image and readies the overlay:
// a fresh one (each run starts from the image, as a container starts from
// its image), or with state policy Retain the one the last run left
// (state.go).
func (p *VMs) vmSpec(ctx context.Context, rec *podVM, pod *corev1.Pod, plan podspec.Plan, img *oci.Image) (qemu.Spec, error) {
	accel := qemu.Accelerator(p.cfg.Accelerator)
	if plan.Accelerator != "" {
		accel = qemu.Accelerator(plan.Accelerator)
	}
	spec := qemu.Spec{
		Name:        vmName(pod),
		Arch:        p.arch(),
		QEMUBinary:  p.cfg.QEMUBinary,
		Accelerator: accel,
		Machine:     plan.Machine,
		CPUs:        plan.CPUs,
		MemoryMiB:   plan.MemoryMiB,
		Firmware:    plan.Firmware,
		Kernel:      img.Kernel,
		Initrd:      img.Initrd,
		Cmdline:     strings.TrimSpace(img.Cmdline + " " + plan.ExtraCmdline),
		Network:     true,
		AllowedDirs: []string{p.cfg.ImageDir},
		StateDir:    rec.dir,
		Memory:      p.cfg.Memory,
		Nice:        p.cfg.VMNice,
		Display:     plan.Display,
		// features.consoleLogSize in force when the VM starts.
		ConsoleCapBytes: p.Features().ConsoleLogSize,
		Cgroup:          podspec.VMCgroup(p.cfg.VMCgroup, plan, p.cfg.VMOverhead),
	}
	if img.Kernel != "" {
		spec.Cmdline = podspec.KernelCmdline(p.arch(), img.Cmdline, plan.ExtraCmdline) // the arch's console unless one is named
		spec.Cmdline = podspec.EmulatedKernelCmdline(p.arch(), spec.Accelerator, spec.Cmdline, p.cfg.EmulatedKernelArgs)
	}
	if plan.Firmware == qemu.FirmwareUEFI {
		spec.UEFICode, spec.UEFIVarsTemplate = p.cfg.UEFICode, p.cfg.UEFIVars
		spec.AllowedDirs = append(spec.AllowedDirs, filepath.Dir(p.cfg.UEFICode), filepath.Dir(p.cfg.UEFIVars))
	}
	p.applyFlashedFirmware(rec, &spec) // exporter_flash.go
	if img.Kernel == "" && plan.ExtraCmdline != "" {
		return spec, podspec.InvalidSpec{Err: fmt.Errorf("annotation %s: image %s has no kernel to pass a command line to", podspec.AnnotationKernelCmdline, plan.Image)}
	}
	overlay := filepath.Join(rec.dir, OverlayFileName)
	if img.Disk != "" {
		spec.Disks = []qemu.Disk{{Path: overlay, Format: qemu.FormatQCOW2}}
	}
	if err := p.checkExporterConfig(ctx, pod); err != nil {
		return spec, err // exporter.go: the pod waits for its exporter Secret
	}
	guest, err := podspec.PrepareGuestDisks(ctx, rec.dir, pod, podspec.ConfigSources{Secret: p.cfg.Secrets, ConfigMap: p.cfg.ConfigMaps})
	if err != nil {
		return spec, err
	}
	spec.Disks = append(spec.Disks, guest...)
	base, baseFormat := img.Disk, qemu.DiskFormat(img.DiskFormat)
	if b := p.prepareSnapshotStart(ctx, rec, pod, plan, img, &spec); b != "" { // snapshots.go
		base, baseFormat = b, qemu.FormatQCOW2
	}
	if err := spec.Validate(); err != nil {
		return spec, podspec.InvalidSpec{Err: fmt.Errorf("VM spec for image %s: %w", plan.Image, err)}
	}
	if img.Disk != "" {
		reason, msg, err := prepareOverlay(ctx, plan.StatePolicy, overlay, base, baseFormat) // state.go
		if err != nil {
			return spec, err
		}
		if reason != "" {
			klog.FromContext(ctx).Info("VM disk", "reason", reason, "message", msg)
			p.event(pod, corev1.EventTypeNormal, reason, msg)
		}
		if plan.DiskBytes > 0 { // set through the exporter (vmsize.go)
			grew, err := qemu.GrowImage(ctx, overlay, plan.DiskBytes)
			if err != nil {
				return spec, err
			}
			if grew {
				p.event(pod, corev1.EventTypeNormal, podstatus.ReasonResized, fmt.Sprintf("VM disk grown to %s", podspec.BytesOf(plan.DiskBytes)))
			}
		}
	}
	return spec, nil
}

// arch is the node's guest architecture.
func (p *VMs) arch() qemu.Arch {
	if p.cfg.Arch != "" {
		return p.cfg.Arch
	}
	return qemu.HostArch()
}

// vmName is a QEMU-safe label: namespace.name, cut to 63 characters.
func vmName(pod *corev1.Pod) string {
	n := pod.Namespace + "." + pod.Name
	if len(n) > 63 {
		n = n[:63]
	}
	return strings.TrimRight(n, ".-_")
}

func imageID(img *oci.Image) string {
	repo := img.Ref
	if i := strings.Index(repo, "@"); i >= 0 {
		repo = repo[:i]
	} else if i := strings.LastIndex(repo, ":"); i > strings.LastIndex(repo, "/") {
		repo = repo[:i]
	}
	return repo + "@" + img.Digest
}

// pullSecrets reads the pod's pull secrets as Docker config JSON documents;
// a missing secret is skipped with an event, as the kubelet does.
func (p *VMs) pullSecrets(ctx context.Context, pod *corev1.Pod, names []string) [][]byte {
	if p.cfg.Secrets == nil {
		return nil
	}
	var out [][]byte
	for _, n := range names {
		s, err := p.cfg.Secrets(ctx, pod.Namespace, n)
		if err != nil {
			p.event(pod, corev1.EventTypeWarning, "FailedToRetrieveImagePullSecret",
				fmt.Sprintf("Unable to retrieve image pull secret %q; the image pull may not succeed: %v", n, err))
			continue
		}
		if b, ok := s.Data[corev1.DockerConfigJsonKey]; ok {
			out = append(out, b)
		} else if b, ok := s.Data[corev1.DockerConfigKey]; ok {
			out = append(out, []byte(`{"auths":`+string(b)+`}`))
		}
	}
	return out
}

func (p *VMs) releaseImage(rec *podVM) {
	rec.mu.Lock()
	rel := rec.release
	rec.release = nil
	rec.mu.Unlock()
	if rel != nil {
		rel()
	}
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
